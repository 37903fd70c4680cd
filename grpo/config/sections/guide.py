"""The guide's spellings of merged options (--learning_rate_lora, bare --use_kl_penalty, bare --use_vllm_rollout,
--vllm_mode): options too, folded into the options they name at construction and then None
(grpo/config/guide_spellings.py). They are checked as the options they set."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config.guide_spellings import GUIDE_SPELLINGS
from grpo.config.sections.option import option


@dataclass
class GuideSpellings:
    learning_rate_lora: Optional[float] = option(None, f"= {GUIDE_SPELLINGS['learning_rate_lora']}.", "guide")
    use_kl_penalty: Optional[bool] = option(None, f"= {GUIDE_SPELLINGS['use_kl_penalty']}.", "guide")
    use_vllm_rollout: Optional[bool] = option(None, f"= {GUIDE_SPELLINGS['use_vllm_rollout']}.", "guide")
    vllm_mode: Optional[str] = option(None, f"= {GUIDE_SPELLINGS['vllm_mode']}.", "guide")
