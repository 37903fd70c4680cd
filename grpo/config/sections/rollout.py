"""The rollout engine: which engine generates, where it runs (colocated or server mode), what it holds of the policy,
streaming and staleness, vLLM's memory and sleep, routing replay, and the checks of those options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config.choices import ROLLOUT_ENGINES, ROLLOUT_MODES, ROLLOUT_WEIGHTS
from grpo.config.job import job_world_size
from grpo.config.sections.option import need, option


@dataclass
class RolloutOptions:
    rollout_engine: str = option(
        "hf", "What generates the rollouts: hf (Hugging Face generate on the policy itself; CPU or GPU) or vllm "
              "(GPU, pip install .[vllm]; the trained weights are pushed into it after every step).", "rollout",
        choices=ROLLOUT_ENGINES)
    vllm_tp: int = option(1, "Tensor-parallel size of each vLLM engine; must divide the number of ranks (in server "
                           "mode: --rollout_gpus).", "rollout")
    rollout_mode: str = option(
        "colocate", "Where the engine runs. colocate: every rank trains and generates (the engine sleeps while "
                    "DeepSpeed trains). server: the last --rollout_gpus ranks of the job only generate (with "
                    "--rollout_engine), the others only train; completions and the updated policy travel between "
                    "them after every step.", "rollout", choices=ROLLOUT_MODES)
    rollout_weights: str = option(
        "auto", "What the vLLM engine holds of a lora / qlora policy (docs/qlora.md). merged: a 16-bit copy, the "
                "adapter merged in at every sync. adapter: the base once (lora: shared with the trainer; qlora: its "
                "4-bit base) plus the adapter, all a sync sends. in_place (lora): the base once, shared with the "
                "trainer, the adapter merged in for each rollout and taken out after, bit for bit. auto: the memory "
                "plan's (docs/memory.md): by preference in_place for lora once the 16-bit copy would take 8 GiB (4.3B "
                "parameters) or over 25 percent of the budget, adapter over 40 percent for qlora (and lora where "
                "in_place cannot go) and always for a checkpoint saved in 4 bits, merged otherwise (faster there, and "
                "with --vllm_tp > 1 or loftq); the first that fits with the step's sequences in its KV cache at once.",
        "rollout", choices=ROLLOUT_WEIGHTS)
    async_rollout: bool = option(
        False, "With --rollout_mode server: the rollout ranks generate the next step's rollouts while this step trains "
               "(one step off policy, corrected by the truncated IS weights; rollout/staleness is logged).",
        "rollout")
    max_staleness: Optional[int] = option(
        None, "With --rollout_mode server: rollouts stream "
              "(docs/server_mode.md#streaming-rollouts---max_staleness-k). The rollout ranks generate without "
              "stopping, up to K steps' prompts ahead of training, and take each weight update as it comes; every "
              "token carries the policy version that sampled it, and no step trains on a group more than K versions "
              "behind (such a group is generated again). 1 is --async_rollout. Default: 1 with --async_rollout, else "
              "off.", "rollout")
    rollout_segment_tokens: int = option(
        0, "With --max_staleness (or --async_rollout): the rollout ranks generate in pieces of N tokens of every "
           "sequence in flight, taking new weights and new prompts between two pieces, so a weight update lands in the "
           "middle of sequences (partial rollouts: a sequence goes on under the new weights, its earlier tokens keep "
           "their version and log-probs). 0: whole completions per request, updates land between requests.", "rollout")
    partial_rollouts: str = option(
        "continue", "With --rollout_segment_tokens: what a sequence in flight does when new weights arrive. continue: "
                    "it goes on under them (each token weighted by the policy that sampled it); restart: it starts "
                    "again from its prompt under the new weights.", "rollout", choices=("continue", "restart"))
    rollout_gpus: int = option(0, "With --rollout_mode server: how many of the job's ranks (the last ones) run rollout "
                                "engines; at least 1 and fewer than the job's ranks.", "rollout")
    vllm_gpu_memory_utilization: Optional[float] = option(
        None, "Fraction of GPU memory vLLM may take, where its KV cache is not given in bytes: the rollout ranks of "
              "server mode (default 0.85: their GPUs only generate) and models without a plain per-token cache (MLA, "
              "hybrid attention; default 0.3 colocated). A colocated engine otherwise gets the memory plan's bytes.",
        "rollout")
    vllm_kv_cache_gib: Optional[str] = option(
        None, "vLLM's KV cache per GPU, in bytes the memory plan gives it (docs/memory.md). auto: one step's "
              "rollouts at once (tp x prompts per rank x k sequences of --max_prompt_length + "
              "--rollout_max_new_tokens tokens, plus a quarter) where the budget holds them, else what it holds (never "
              "less than one --max_seq_length sequence: the rest run in waves); under --gpu_memory_gib it leaves "
              "training micro-batches of 4096 tokens (or one row). A number: that many GiB. share: what "
              "--vllm_gpu_memory_utilization leaves after the weights (as for models without a plain cache: MLA, "
              "hybrid linear attention). Default: auto colocated, share in server mode.", "rollout")
    vllm_sleep: bool = option(True, "Put vLLM to sleep while DeepSpeed trains, freeing what --vllm_sleep_level says. "
                                    "false: it stays awake, and a lora / qlora sync sends only the adapted layers. "
                                    "Colocated vLLM only (rollout ranks of server mode never sleep).", "rollout")
    vllm_sleep_level: Optional[int] = option(
        None, "With --vllm_sleep: 0 frees the KV cache alone, the weights stay, and a sync writes only what changed "
              "into them; 2 drops the weights, and every sync sends the whole policy (a copy on the GPU); 1 parks "
              "them in pinned CPU memory and copies them back at each wake. Default: 0 for lora / qlora with merged "
              "weights on one GPU where vLLM's 16-bit copy takes at most a quarter of the GPU, else 2; an engine "
              "holding the base once keeps it (parked as at 1, or shared with the trainer: the KV cache alone).",
        "experimental", choices=(0, 1, 2))
    logprob_check_steps: int = option(
        10, "Ask the rollout engine for its sampling log-probs every N steps, for the rollout/logprob_diff metric "
            "(always with --rollout_is_correction); vLLM generates faster without them.", "experimental")
    vllm_enforce_eager: bool = option(False, "Run vLLM without CUDA graphs / torch.compile (starts faster).",
                                    "rollout")
    routing_replay: Optional[bool] = option(
        None, "Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the rollout engine records the experts it "
              "routed each token to, and the trainer's MoE layers use that choice while their gate weights come from "
              "the trainer's own router (docs/moe.md#routing-replay); rollout/router_agreement is logged. Default: on "
              "for those models (it costs 4 bytes per token, layer and routed expert); a dense model has nothing to "
              "replay, and refuses it.",
        "rollout", nargs="?", const=True)  # a bare flag means true

    def check_rollout(self) -> None:
        need(self.vllm_tp >= 1, "vllm_tp", "must be >= 1")
        need(self.logprob_check_steps >= 1, "logprob_check_steps", "must be >= 1")
        world = job_world_size()
        need(self.rollout_engine in ROLLOUT_ENGINES, "rollout_engine",
             f"got '{self.rollout_engine}', choose one of {', '.join(ROLLOUT_ENGINES)}")
        need(self.rollout_mode in ROLLOUT_MODES, "rollout_mode",
             f"got '{self.rollout_mode}', choose one of {', '.join(ROLLOUT_MODES)}")
        if self.rollout_mode == "server":
            need(1 <= self.rollout_gpus < world, "rollout_gpus",
                 f"server mode needs at least 1 rollout rank and at least 1 training rank: got {self.rollout_gpus} of "
                 f"the job's {world} ranks (start more with `deepspeed --num_gpus N`, or use --rollout_mode colocate)")
            need(self.rollout_gpus % self.vllm_tp == 0, "vllm_tp",
                 f"must divide --rollout_gpus {self.rollout_gpus}; got {self.vllm_tp}")
        else:
            need(self.rollout_gpus == 0, "rollout_gpus",
                 "is for --rollout_mode server (colocate: every rank generates)")
            need(not self.async_rollout, "async_rollout",
                 "needs --rollout_mode server (colocated engines share the GPU with training, so nothing overlaps)")
            need(self.max_staleness is None, "max_staleness",
                 "needs --rollout_mode server (colocated engines share the GPU with training, so nothing overlaps)")
            need(world % self.vllm_tp == 0, "vllm_tp",
                 f"must divide the number of ranks (WORLD_SIZE={world}); got {self.vllm_tp}")
        self._check_rollout_weights()
        need(self.max_staleness is None or self.max_staleness >= 1, "max_staleness",
             f"must be at least 1 (1 is --async_rollout; leave it unset to generate every step's rollouts on the "
             f"step's policy); got {self.max_staleness}")
        need(self.rollout_segment_tokens >= 0, "rollout_segment_tokens", "must be >= 0 (0: whole completions)")
        need(self.partial_rollouts in ("continue", "restart"), "partial_rollouts",
             f"got '{self.partial_rollouts}', choose continue or restart")
        need(self.rollout_segment_tokens == 0 or self.rollout_staleness >= 1, "rollout_segment_tokens",
             "streams rollouts: it needs --max_staleness (or --async_rollout)")
        need(self.rollout_segment_tokens == 0 or self.vllm_tp == 1, "rollout_segment_tokens",
             "needs --vllm_tp 1 (the ranks of a tensor-parallel engine must generate the same pieces in step, and "
             "each rank takes new prompts as they come)")
        if self.routing_replay:
            conflict = routing_replay_conflict(self)
            need(conflict is None, "routing_replay", f"{conflict}; drop --routing_replay (or that option)")
        need(self.vllm_gpu_memory_utilization is None or 0.0 < self.vllm_gpu_memory_utilization < 1.0,
             "vllm_gpu_memory_utilization", "must be in (0, 1)")
        kv_cache = self.vllm_kv_cache  # raises on a value that is neither auto, share nor a number of GiB
        need(not (kv_cache == "auto" and self.rollout_mode == "server"), "vllm_kv_cache_gib",
             "auto is for colocated engines (they give the memory back to training); rollout ranks of server mode "
             "only generate: leave it unset (share) or give a number of GiB")
        need(self.vllm_sleep_level in (None, 0, 1, 2), "vllm_sleep_level",
             f"got {self.vllm_sleep_level}, choose 0, 1 or 2")

    def _check_rollout_weights(self) -> None:
        need(self.rollout_weights in ROLLOUT_WEIGHTS, "rollout_weights",
             f"got '{self.rollout_weights}', choose one of {', '.join(ROLLOUT_WEIGHTS)}")
        if self.rollout_weights == "adapter":
            need(self.strategy.has_adapter, "rollout_weights",
                 "adapter is for --tuning_strategy lora / qlora (a full run has no adapter): use merged")
            need(self.rollout_engine == "vllm", "rollout_weights",
                 "adapter needs --rollout_engine vllm (the HF engine samples the live policy, or on a rollout rank "
                 "takes merged weights): use merged")
            need(not (self.strategy.four_bit_base and self.vllm_tp > 1), "rollout_weights",
                 f"adapter with qlora runs the 4-bit base on one GPU per engine (vLLM 0.26 cannot split a "
                 f"pre-quantized model): use --vllm_tp 1 or --rollout_weights merged (got --vllm_tp {self.vllm_tp})")
            need(self.qlora_init != "loftq" or not self.strategy.four_bit_base, "rollout_weights",
                 "adapter cannot carry --qlora_init loftq's rounding correction: use merged")
        if self.rollout_weights == "in_place":
            need(self.strategy.sixteen_bit_adapter, "rollout_weights",
                 "in_place merges a LoRA adapter into a 16-bit base the trainer shares with vLLM: it is for "
                 "--tuning_strategy lora (qlora: adapter or merged)")
            need(self.rollout_engine == "vllm" and self.rollout_mode == "colocate" and self.vllm_tp == 1,
                 "rollout_weights",
                 "in_place shares the base between the trainer and a colocated vLLM engine on the same GPU: it needs "
                 "--rollout_engine vllm, --rollout_mode colocate and --vllm_tp 1 (else use adapter or merged)")


def routing_replay_conflict(config, agent_datasets=()) -> Optional[str]:
    """Why the step cannot carry the engine's routing to the trainer's forward with these options (and these datasets
    played by agents), or None."""
    if config.sequence_parallel_size > 1:
        return (f"--sequence_parallel_size {config.sequence_parallel_size} shards every row over the group's ranks, "
                "and the sharded forward does not take the routing of its share")
    if config.rollout_mode == "server":
        return "--rollout_mode server: the rollout ranks do not send the routing back with the completions"
    played = sorted(set(config.dataset_names) & set(agent_datasets))
    if played:
        return (f"dataset(s) {', '.join(played)} are played by agents, whose calls do not bring back the routing of "
                "their tokens")
    return None
