"""Whether two values of one option make the same run: module lists compare as sets of names ("q_proj, v_proj" and
"v_proj,q_proj" build the same adapter). A resume (grpo/checkpoint/resume.py) and an adapter's record of its 4-bit base
(grpo/model/qlora_base_record.py) compare saved options with today's this way."""
from __future__ import annotations


def as_compared(key: str, value):
    """Module lists compare as sets of names: "q_proj, v_proj" and "v_proj,q_proj" build the same adapter."""
    if key.endswith("_modules") and isinstance(value, str):
        return frozenset(name.strip() for name in value.split(",") if name.strip())
    return value
