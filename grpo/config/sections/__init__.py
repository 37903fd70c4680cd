"""GRPOConfig's options in sections, each a dataclass mixin with its fields and the checks beside them."""
