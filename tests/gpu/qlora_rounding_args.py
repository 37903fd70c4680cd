"""--qlora_block_size / --qlora_block_scale for the GPU check scripts (sync_check.py, trainer_start_check.py)."""


def add_qlora_rounding_args(parser) -> None:
    parser.add_argument("--qlora_block_size", type=int)
    parser.add_argument("--qlora_block_scale")


def qlora_rounding(args) -> dict:
    """The options where given (else grpo's defaults), only for qlora (other strategies refuse them)."""
    if args.strategy != "qlora":
        return {}
    given = {"qlora_block_size": args.qlora_block_size, "qlora_block_scale": args.qlora_block_scale}
    return {option: value for option, value in given.items() if value is not None}
