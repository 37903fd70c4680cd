"""How much arithmetic a 4-bit base keeps: on `arith`'s held-out prompts, the policy grpo would train (full, or the
nf4 QLoRA base with some modules left unquantized) completes "<a> + <b> = " greedily, before any training step.

Per variant: accuracy of the greedy number, and the mean negative log-likelihood (nats) of the right answer's
tokens. A QLoRA run can learn the format, but the numbers it boxes come from this base (CPU or GPU; no vLLM).
A "qlora" variant is bitsandbytes' stock base (nf4 in blocks of 64, absmax scales) unless its name says otherwise:
"qlora/32=mse" is grpo's default qlora base.

    python benchmarks/quantized_arithmetic.py                                    # full, qlora, MLP / attention kept
    python benchmarks/quantized_arithmetic.py --variants qlora qlora+loftq "qlora:down_proj" --prompts 50
    python benchmarks/quantized_arithmetic.py --variants qlora qlora@fp4 qlora@fp4+loftq   # the 4-bit data type
    python benchmarks/quantized_arithmetic.py --variants qlora qlora/32     # bitsandbytes' 64 weights per scale, or 32
    python benchmarks/quantized_arithmetic.py --variants qlora/32 qlora/32=mse    # --qlora_block_scale mse
    python benchmarks/quantized_arithmetic.py --variants full --rounding nf4/64 nf4/32 nf4/64/nodq fp4/32 nf4/32/mse
        # the 16-bit model with every linear layer but the output rounded through bitsandbytes: data type / weights
        # per scale / nodq: scales kept in 32 bits instead of bitsandbytes' double quantization / mse: each block's
        # scale chosen as --qlora_block_scale mse does
    python benchmarks/quantized_arithmetic.py --variants full --rounding nf4/32 nf4/32/mse --prompts 400 --rows train
        # scored on 400 training prompts instead of the 100 held-out ones: less noise (nothing is trained here)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

DEFAULT_VARIANTS = ["full", "qlora", "qlora:gate_proj,up_proj,down_proj", "qlora:q_proj,k_proj,v_proj,o_proj"]


def _marked(head: str, mark: str):
    """The word after `mark` in a variant's name ("qlora@fp4+loftq": "@" -> "fp4", "+" -> "loftq"), or None."""
    found = re.search(re.escape(mark) + r"(\w+)", head)
    return found.group(1) if found else None


def build_trainer(model: str, variant: str, prompts: int, out_dir: str, **overrides):
    """A GRPOTrainer on `arith` for a variant: "full", "qlora", "qlora@fp4", "qlora+loftq", "qlora/32" (weights per
    4-bit scale), "qlora=mse" (how each scale is chosen), "qlora:<kept modules>". `overrides`: other GRPOConfig
    fields (another dataset, its lengths)."""
    from grpo.config.options import BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE, GRPOConfig
    from grpo.train.trainer import GRPOTrainer

    head, _, skip = variant.partition(":")
    # "qlora+loftq": the rounding correction on; "qlora@fp4": the 4-bit data type; "qlora/32": the block size;
    # "qlora=mse": the block scale; any order. What a name leaves out is bitsandbytes' stock choice.
    strategy, init, quant = re.split(r"[@+/=]", head)[0], _marked(head, "+"), _marked(head, "@")
    block, scale = _marked(head, "/"), _marked(head, "=")
    settings = {"dataset_names": ["arith"], "max_prompt_length": 128, "max_seq_length": 192,
                "rollout_max_new_tokens": 64, **overrides}
    config = GRPOConfig(model_name_or_path=model, output_dir=out_dir,
                        overwrite_output_dir=True, tuning_strategy=strategy, qlora_skip_modules=skip or None,
                        **({"qlora_init": init} if init else {}), **({"qlora_quant_type": quant} if quant else {}),
                        **({"qlora_block_size": int(block or BITSANDBYTES_BLOCK_SIZE),
                            "qlora_block_scale": scale or BITSANDBYTES_BLOCK_SCALE} if strategy == "qlora" else {}),
                        eval_max_prompts=prompts, max_steps=1, save_steps=0, seed=0, **settings)
    return GRPOTrainer(config)


def variant_trainers(model: str, variants: list[str], prompts: int, **overrides):
    """(variant, its GRPOTrainer, start time) for each variant in turn: one trainer at a time, as each owns the
    process group's engine; the policy is built as for training (quantization, dtype, device)."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    for variant in variants:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out_dir:
            yield variant, build_trainer(model, variant, prompts, out_dir, **overrides), start


def score(model, tokenizer, rows) -> dict:
    model.eval()
    device = next(model.parameters()).device
    right, nll = 0, 0.0
    with torch.no_grad():
        for row in rows:
            expression = re.search(r"What is (.*?)\?", row["prompt_text"]).group(1)
            ids = list(row["prompt_ids"]) + tokenizer.encode(f"{expression} = ", add_special_tokens=False)
            generated = torch.tensor([ids], device=device)
            for _ in range(4):  # answers are at most 3 digits and a sign
                next_id = model(input_ids=generated).logits[0, -1].argmax()
                generated = torch.cat([generated, next_id.view(1, 1)], 1)
            number = re.match(r"\s*(-?\d+)", tokenizer.decode(generated[0, len(ids):]))
            right += int(bool(number) and number.group(1) == str(row["answer"]).strip())
            answer = tokenizer.encode(str(row["answer"]).strip(), add_special_tokens=False)
            full = torch.tensor([ids + answer], device=device)
            logprobs = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1:-1].float(), -1)
            nll -= logprobs.gather(-1, torch.tensor(answer, device=device)[:, None]).sum().item()
    return {"accuracy": right / len(rows), "answer_nll": nll / len(rows)}


def round_linear_layers(model, rounding: str) -> float:
    """Round every linear weight but the output layer's in place, as bitsandbytes stores it ("nf4/32": data type,
    weights per scale, "/nodq": scales not quantized again, "/mse": scales as --qlora_block_scale mse chooses them)
    and back. Returns the relative error over all of them."""
    from grpo.model.qlora_rounding import codebook, mse_block_rounding, round_4bit

    quant_type, blocksize, *rest = rounding.split("/")
    error, norm = 0.0, 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            weight = module.weight.data
            given = mse_block_rounding(weight, codebook(quant_type), int(blocksize)).to(weight.dtype) \
                if "mse" in rest else weight
            rounded = round_4bit(given, quant_type, int(blocksize), double_quant="nodq" not in rest)
            error += (rounded - weight).float().pow(2).sum().item()
            norm += weight.float().pow(2).sum().item()
            weight.copy_(rounded)
    return (error / norm) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                        help='full, lora, qlora, "qlora+loftq", "qlora@fp4", "qlora/32", "qlora=mse", or '
                             '"qlora:<modules left unquantized, comma-separated>"')
    parser.add_argument("--prompts", type=int, default=100, help="arith prompts scored")
    parser.add_argument("--rows", choices=["eval", "train"], default="eval",
                        help="score the held-out prompts (100), or the first training prompts (nothing is trained)")
    parser.add_argument("--rounding", nargs="*", default=[],
                        help='with the "full" variant: also score it rounded as '
                             '"<nf4|fp4>/<weights per scale>[/nodq][/mse]"')
    args = parser.parse_args()
    results = []
    for variant, trainer, start in variant_trainers(args.model, args.variants, args.prompts):
        rows = list(trainer.eval_set if args.rows == "eval" else trainer.train_set)[:args.prompts]
        model = trainer.engine.module
        accuracy = score(model, trainer.tokenizer, rows)
        results.append({"variant": variant, "prompts": len(rows), **accuracy,
                        "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(results[-1]), flush=True)
        if variant == "full" and args.rounding:
            original = {name: p.detach().clone() for name, p in model.named_parameters()}
            for rounding in args.rounding:
                relative_error = round_linear_layers(model, rounding)
                results.append({"variant": f"full rounded {rounding}", "prompts": len(rows),
                                **score(model, trainer.tokenizer, rows), "relative_error": round(relative_error, 4)})
                print(json.dumps(results[-1]), flush=True)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(original[name])
        del trainer
    print("\n| variant | prompts | greedy accuracy | answer NLL (nats) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['prompts']} | {r['accuracy']:.2f} | {r['answer_nll']:.2f} |")


if __name__ == "__main__":
    main()
