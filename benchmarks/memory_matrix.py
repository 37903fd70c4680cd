"""The memory plan against real runs: random-weight models of published shapes (tests/model_configs) x GPU budgets x
completion lengths, qlora (or --strategy) with the defaults otherwise, 4 prompts x 8 samples on `arith`.

Every cell is planned first (in this process, no weights); a cell whose plan does not fit is recorded as refused,
with the change the refusal names; the others run train_grpo.py for --steps steps, LANES at a time on one GPU (each
under its own --gpu_memory_gib: several runs share the GPU, as users' runs do), and each run's measured peaks per
phase (metrics.jsonl's memory/*) are set beside the planned ones. Prints a markdown table and appends
results.jsonl under --out. Without a GPU (or with --plan_only) only the plans.

    python benchmarks/memory_matrix.py --plan_only                                    # the whole matrix's plans
    python benchmarks/memory_matrix.py --replan /root/mm     # its measured runs against the current plan (no GPU)
    python benchmarks/memory_matrix.py --shapes llama-3.1-8b qwen2.5-7b --budgets 24 --new 4096 --lanes 2 \\
        --model_root /root/models --steps 2                                      # on a GPU: build, plan, run
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHAPES = ["qwen2.5-7b", "llama-3.1-8b", "qwen3-8b", "mistral-7b", "gemma-2-9b"]
GIB = 2**30


VL_SHAPES = {"qwen2.5-vl-7b"}  # built by random_model.py --shape (bf16, Qwen-VL tokens and processor), image prompts


def flags(model: str, args, budget: float, new: int, out: str) -> list[str]:
    dataset = "shapes" if os.path.basename(model.rstrip("/")) in VL_SHAPES else "arith"
    return ["--model_name_or_path", model, "--tuning_strategy", args.strategy, "--rollout_engine", "vllm",
            "--dataset_names", dataset, "--per_device_train_batch_size", str(args.prompts), "--k_samples",
            str(args.samples), "--rollout_max_new_tokens", str(new), "--max_steps", str(args.steps),
            "--save_steps", "0", "--eval_on_start", "false", "--train_split_ratio", "1.0", "--logging_steps", "1",
            "--logprob_check_steps", "1", "--output_dir", out, "--overwrite_output_dir",
            "--gpu_memory_gib", f"{budget:g}"] + args.extra


def plan_cell(model: str, args, budget: float, new: int) -> dict:
    from grpo.config import parse_args
    from grpo.errors import ConfigError
    from grpo.memory.advice import cheapest_fixes
    from grpo.memory.planner import named_card, plan_parts
    from grpo.model.model_source import check_positions

    config = parse_args(flags(model, args, budget, new, "/tmp/unused"))
    import torch

    gpu = None if torch.cuda.is_available() else named_card(budget)
    try:  # what no memory lifts (the model's positions, a layout): refused before loading, as the run is
        check_positions(model, config)
        plan, run, size, gpu, hf_config = plan_parts(config, model, gpu=gpu)
    except ConfigError as exc:
        return {"fits": False, "planned_gib": {}, "why_not": str(exc), "fixes": [str(exc).rsplit(": ", 1)[-1]]}
    row = {"fits": plan.fits, "planned_gib": {k: round(v / GIB, 2) for k, v in plan.phases.items()},
           "weights": plan.rollout_weights, "kv_gib": round((plan.kv_cache_bytes or 0) / GIB, 2),
           "at_once": round(plan.sequences_at_once, 1), "micro_batch": plan.micro_batch_tokens}
    if not plan.fits:
        row["why_not"] = plan.why_not
        row["fixes"] = cheapest_fixes(run, size, gpu, hf_config, config)
    return row


def replan(folders: list[str], args) -> None:
    """The measured runs of earlier matrices (their results.jsonl and each run's memory_plan.json) planned again by
    the current equations, with the choices each run made (micro-batch tokens, log-prob chunk, KV cache bytes) and
    its checkpoint's form (4-bit or 16-bit, from the config here): measured / planned per phase. No GPU needed."""
    from grpo.config import parse_args
    from grpo.memory.planner import named_card, plan_parts

    print("| shape | budget GiB | new tokens | rollout | log-probs | train | sync |")
    print("|---|---|---|---|---|---|---|")
    for folder in folders:
        for line in open(os.path.join(folder, "results.jsonl")):
            cell = json.loads(line)
            name = f"{cell['shape']}-{args.strategy}-{cell['budget']:g}gib-{cell['new']}new"
            plan_file = os.path.join(folder, "runs", name, "memory_plan.json")
            if cell.get("rc") != 0 or not os.path.isfile(plan_file):
                continue
            ran = json.load(open(plan_file))
            model = config_copy(cell["shape"], four_bit=cell["model"].endswith("-4bit"))
            pinned = ["--max_tokens_per_micro_batch", str(ran["micro_batch_tokens"]), "--logprob_chunk_tokens",
                      str(ran["logprob_chunk_tokens"])] + \
                (["--vllm_kv_cache_gib", f"{ran['kv_cache_bytes'] / GIB:.6f}"] if ran.get("kv_cache_bytes") else [])
            extra, args.extra = args.extra, args.extra + pinned
            plan = plan_parts(parse_args(flags(model, args, cell["budget"], cell["new"], "/tmp/unused")), model,
                              gpu=named_card(cell["budget"]))[0]
            args.extra = extra
            row = []
            for phase in ("rollout", "logprobs", "train", "sync"):
                got, planned = cell["measured_gib"].get(phase), plan.phases.get(phase, 0) / GIB
                row.append(f"{got:.2f} / {planned:.2f} ({got / planned - 1:+.0%})" if got and planned else "-")
            print(f"| {cell['shape']} | {cell['budget']:g} | {cell['new']} | " + " | ".join(row) + " |")


def config_copy(shape: str, four_bit: bool) -> str:
    """tests/model_configs/<shape> as the run loaded it: with the quantization config of a 4-bit checkpoint where
    the run's was one (config files only; the plan reads no weights)."""
    import shutil
    import tempfile

    source = os.path.join(ROOT, "tests", "model_configs", shape)
    if not four_bit:
        return source
    import torch

    from grpo.model.quantized_checkpoint import bitsandbytes_4bit_config

    folder = os.path.join(tempfile.gettempdir(), "grpo_replan", shape + "-4bit")
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.load(open(os.path.join(source, "config.json")))
    config["quantization_config"] = bitsandbytes_4bit_config("nf4", True, torch.bfloat16, ["lm_head"])
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, default=str)
    return folder


def reserved(cell: dict) -> float:
    """GiB a running cell may hold: its planned peak +10% (the plan's own tolerance), within its budget."""
    return min(cell["budget"], 1.1 * max(cell["planned_gib"].values()))


def gpu_memory(index: int) -> tuple[float, dict[int, float]]:
    """NVML through nvidia-smi (no CUDA context here): the GPU's free GiB and GiB held by each process on it."""
    def query(*args):
        out = subprocess.run(["nvidia-smi", "-i", str(index), *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return [line.split(",") for line in out.strip().splitlines() if line.strip()]

    free = float(query("--query-gpu=memory.free")[0][0]) / 1024
    held = {int(pid): float(mib) / 1024 for pid, mib in query("--query-compute-apps=pid,used_memory")}
    return free, held


def process_tree(root: int) -> set[int]:
    """The pid and every process below it (the launcher's ranks, their engine's workers)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def room_for(cell: dict, running: list, gpu: int) -> bool:
    """Whether the GPU holds the cell's whole budget now, beside what every process on it holds (other jobs'
    too: runs that share a GPU see each other only there) and what this matrix's running runs may still take
    (their reserve beyond what they hold)."""
    free, held = gpu_memory(gpu)
    growth = 0.0
    for other, process, *_ in running:
        holding = sum(held.get(pid, 0.0) for pid in process_tree(process.pid))
        growth += max(0.0, reserved(other) - holding)
    return free >= cell["budget"] + growth


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start(model: str, args, budget: float, new: int, name: str):
    out = os.path.join(args.out, "runs", name)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # --include pins the GPU: DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES (with --num_gpus 1 every run lands on 0)
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--include", f"localhost:{args.gpu}", "--master_port",
               str(free_port()), os.path.join(ROOT, "train_grpo.py")] + flags(model, args, budget, new, out)
    log = open(out + ".log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), out, time.time()


def measured(out: str) -> dict:
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    steps = [r for r in rows if "time/step" in r]
    peaks = {}
    for r in steps:
        for key, value in r.items():
            if key.startswith("memory/") and not key.endswith("_planned_gib"):
                phase = key[len("memory/"):-len("_gib")]
                peaks[phase] = max(peaks.get(phase, 0), value)
    return {"steps": len(steps), "measured_gib": peaks,
            "step_s": round(sum(r["time/step"] for r in steps[1:]) / max(len(steps) - 1, 1), 1) if steps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--budgets", nargs="+", type=float, default=[16, 24, 40, 80])
    parser.add_argument("--new", nargs="+", type=int, default=[512, 4096, 8192])
    parser.add_argument("--strategy", default="qlora")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=1, help="runs at once on the GPU, at most")
    parser.add_argument("--gpu_gib", type=float, default=None,
                        help="the sum of the budgets of the runs at once, at most (default: the GPU's memory - 4)")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--four_bit", action="store_true", help="build the models saved in 4 bits")
    parser.add_argument("--model_root", default=None, help="where the random models are (built if missing)")
    parser.add_argument("--out", default="outputs/bench/memory_matrix")
    parser.add_argument("--plan_only", action="store_true")
    parser.add_argument("--replan", nargs="+", default=None, metavar="OUT",
                        help="earlier --out folders: their measured runs against the current plan (no GPU)")
    parser.add_argument("--limit", type=int, default=900, help="seconds a run may take")
    parser.add_argument("--cells", nargs="+", default=None, metavar="SHAPE:GIB:NEW",
                        help="these cells only, started in the order given where they fit (instead of shapes x "
                             "budgets x new tokens, shortest first), e.g. mistral-7b:24:4096 qwen3-8b:40:512")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    wanted = None
    if args.cells:
        wanted = [(shape, float(budget), int(new)) for shape, budget, new in (c.split(":") for c in args.cells)]
        args.shapes = list(dict.fromkeys(shape for shape, _, _ in wanted))
    if args.replan:
        replan(args.replan, args)
        return
    os.makedirs(args.out, exist_ok=True)
    cells = []
    for shape in args.shapes:
        model = os.path.join(ROOT, "tests", "model_configs", shape)
        if not args.plan_only:
            vl = shape in VL_SHAPES  # saved in bf16 (qlora quantizes it on load)
            model = os.path.join(args.model_root, shape + ("-4bit" if args.four_bit and not vl else ""))
            source = (["--shape", shape] if vl else
                      ["--config", os.path.join(ROOT, "tests", "model_configs", shape)]
                      + (["--four_bit"] if args.four_bit else []))
            if not os.path.isfile(os.path.join(model, "config.json")):
                subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "random_model.py"), "--out", model]
                               + source, check=True)
        for budget, new in ([(b, n) for s_, b, n in wanted if s_ == shape] if wanted
                            else [(b, n) for b in args.budgets for n in args.new]):
            cell = {"shape": shape, "budget": budget, "new": new, "model": model}
            cell.update(plan_cell(model, args, budget, new))
            cells.append(cell)
            print(json.dumps({k: v for k, v in cell.items() if k != "model"}), flush=True)
    running = []
    # the shortest completions first (where the GPU's time runs out, the most cells have run), or the order asked
    order = ((lambda c: wanted.index((c["shape"], c["budget"], c["new"]))) if wanted
             else (lambda c: (c["new"], c["budget"])))
    queue = sorted((c for c in cells if c["fits"]), key=order) if not args.plan_only else []
    if queue and args.gpu_gib is None:
        import torch

        args.gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB - 4
    for cell in [c for c in queue if c["budget"] > args.gpu_gib]:  # (it would wait for ever)
        print(f"left out: {cell['shape']} at {cell['budget']:g} GiB, more than --gpu_gib {args.gpu_gib:g}", flush=True)
        queue.remove(cell)
    while queue or running:
        # a run starts when its whole budget is free beside what the running ones may hold (their planned peaks
        # +10%, the most the plan allows itself), and free on the GPU itself beside other jobs there (room_for):
        # each run then plans with its own budget, never with less. The first queued cell that fits starts (a
        # smaller one fills the room a larger one ahead of it waits for), while a lane is free
        for cell in list(queue):
            if len(running) >= args.lanes:
                break
            if (sum(reserved(c) for c, *_ in running) + cell["budget"] <= args.gpu_gib
                    and room_for(cell, running, args.gpu)):
                queue.remove(cell)
                name = f"{cell['shape']}-{args.strategy}-{cell['budget']:g}gib-{cell['new']}new"
                running.append((cell, *start(cell["model"], args, cell["budget"], cell["new"], name)))
        time.sleep(5)
        for item in list(running):
            cell, process, out, began = item
            if process.poll() is None and time.time() - began < args.limit:
                continue
            if process.poll() is None:
                process.kill()
            running.remove(item)
            cell.update(rc=process.wait(), wall_s=round(time.time() - began), **measured(out))
            with open(os.path.join(args.out, "results.jsonl"), "a") as fh:
                fh.write(json.dumps(cell) + "\n")
            print(json.dumps(cell), flush=True)
    if args.plan_only:
        print("| shape | budget GiB | new tokens | plan | planned peak GiB |")
        print("|---|---|---|---|---|")
        for c in cells:
            plan = (f"{c['weights']}, KV {c['kv_gib']} ({c['at_once']} at once), mb {c['micro_batch']}" if c["fits"]
                    else f"refused: {'; '.join(c['fixes'][:2])}")
            print(f"| {c['shape']} | {c['budget']:g} | {c['new']} | {plan} | "
                  f"{max(c['planned_gib'].values(), default='-')} |")
        return
    print("| shape | budget GiB | new tokens | plan | rc | planned peak | measured peak | within |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        planned = max(c["planned_gib"].values(), default="-")
        if not c["fits"]:
            print(f"| {c['shape']} | {c['budget']:g} | {c['new']} | refused: {'; '.join(c['fixes'][:2])} | - | "
                  f"{planned} | - | - |")
            continue
        got = max(c.get("measured_gib", {}).values(), default=None)
        within = f"{got / planned - 1:+.0%}" if got else "-"
        print(f"| {c['shape']} | {c['budget']:g} | {c['new']} | {c['weights']}, KV {c['kv_gib']} "
              f"({c['at_once']} at once), mb {c['micro_batch']} | {c.get('rc', '-')} | {planned} | {got} | {within} |")


if __name__ == "__main__":
    main()
