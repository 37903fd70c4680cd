"""The built-in `python` tool: the model's code in a separate, limited Python process.

Limits, each enforced by the operating system rather than by trusting the code:
- wall time: the process (and any it started, one process group) is killed at `timeout` seconds; a CPU-time limit
  backs this up;
- memory: RLIMIT_AS caps the address space, so a large allocation raises MemoryError inside the code;
- network: the process runs in a network namespace of its own (`unshare --net`, see launch_plan), which has no
  interfaces besides a loopback that is down: no connection leaves it, whatever the code does (C extensions and child
  processes included). Where namespaces are not allowed (some containers), an audit hook
  refuses sockets, new programs (subprocess, os.exec*, os.system, fork) and loading C libraries with ctypes inside
  the Python process instead; that
  stops Python code but not a compiled extension that calls the C library itself, which is why the namespace comes
  first;
- files: a fresh temporary folder is the working folder and is removed afterwards; written files are capped at
  `max_file_bytes` each (RLIMIT_FSIZE). Run as root, the code runs as user `nobody` (so it cannot change the
  trainer's files) where `nobody` can start the interpreter (not one installed under /root; `python_executable` may
  name another); otherwise, and for any other user, it has the trainer user's file permissions: there is no separate
  file system, so keep secrets out of its reach;
- output: stdout and stderr are cut to `max_output_chars` characters for the model.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from grpo.tools.errors import ToolFailure, ToolTimeout
from grpo.tools.registry import register_tool

NOBODY = 65534


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 10.0              # wall-clock seconds
    memory_bytes: int = 512 * 2**20    # address space of the process
    max_output_chars: int = 2000       # per stream, what the model reads
    max_file_bytes: int = 16 * 2**20   # largest file the code (or its output) may write
    network_isolation: str = "auto"    # "auto" (namespace if allowed, else audit hook) | "namespace" | "audit_hook"
    python_executable: Optional[str] = None  # the interpreter that runs the code (None: this one), e.g. a venv's


# Runs first in the sandboxed interpreter: limits, identity, network guard, then the code as __main__.
_BOOTSTRAP = r"""
import ctypes, os, resource, runpy, sys  # ctypes loads before the guard: numpy and sympy import it
memory, cpu, fsize, drop_to, hook = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
if drop_to >= 0:
    os.setgroups([]); os.setgid(drop_to); os.setuid(drop_to)
if hook == "1":
    _refused = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata")
    def _guard(event, args):
        if event.startswith(_refused):
            raise PermissionError(f"not allowed in the sandbox: {event} (no network, no new processes)")
    sys.addaudithook(_guard)
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))  # last: the steps above need some memory
del os, resource, memory, cpu, fsize, drop_to, hook
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


@functools.lru_cache(maxsize=None)
def unshare_prefix(*options: str) -> Optional[tuple[str, ...]]:
    """`unshare <options> --` if it runs a process here (namespaces may be refused in containers), else None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = (unshare, *options, "--")
    try:
        probe = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if probe.returncode == 0 else None


def namespace_available() -> bool:
    """Whether a network namespace of its own can be made here, by this user."""
    return bool(unshare_prefix("--map-root-user", "--net") or (os.geteuid() == 0 and unshare_prefix("--net")))


def isolation_mode(requested: str) -> str:
    """The network isolation a run gets: "namespace" or "audit_hook"."""
    if requested not in ("auto", "namespace", "audit_hook"):
        raise ValueError(f"network_isolation must be auto, namespace or audit_hook, got {requested!r}")
    if requested == "audit_hook":
        return requested
    if namespace_available():
        return "namespace"
    if requested == "namespace":
        raise RuntimeError("network namespaces are not allowed here (`unshare --net` failed); use "
                           "network_isolation='audit_hook' or 'auto'")
    return "audit_hook"


def launch_plan(mode: str, as_root: bool, nobody_can_start: bool) -> tuple[tuple[str, ...], int, bool]:
    """How to start the code: (command prefix, user id to switch to or -1, whether the audit hook guards it).

    Root keeps the power to re-enter the host's network namespace (setns) unless it gives up root: so root either
    makes a plain network namespace and then runs the code as `nobody`, or runs it as root of a user namespace of its
    own (`--map-root-user`), which holds no power outside; only where neither works does the audit hook guard a
    plain namespace too."""
    drop_to = NOBODY if as_root and nobody_can_start else -1
    if mode == "audit_hook":
        return (), drop_to, True
    plain = unshare_prefix("--net") if as_root else None
    if plain and drop_to >= 0:
        return plain, drop_to, False
    mapped = unshare_prefix("--map-root-user", "--net")
    if mapped:  # its only user is root of the namespace: switching to nobody is not possible there
        return mapped, -1, False
    return plain, drop_to, drop_to < 0


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits` in a fresh temporary folder and return what it printed (each stream truncated)."""
    python = limits.python_executable or sys.executable
    as_root = os.geteuid() == 0
    prefix, drop_to, hook = launch_plan(isolation_mode(limits.network_isolation), as_root,
                                        as_root and nobody_can_run(python))
    return _run(code, limits, python, prefix, drop_to, hook)


@functools.lru_cache(maxsize=None)
def nobody_can_run(python: str) -> bool:
    """Whether user `nobody` can start this interpreter and import its standard library (not so for one installed
    under /root, mode 0700): only then does the code run as `nobody`. Found out once, by trying."""
    probe = _run("import json, runpy, site\nprint('ok')", SandboxLimits(timeout=30), python, (), NOBODY, True)
    return probe.stdout == "ok\n"


def _run(code: str, limits: SandboxLimits, python: str, prefix: tuple, drop_to: int, hook: bool) -> SandboxResult:
    root = tempfile.mkdtemp(prefix="grpo-python-tool-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        if drop_to >= 0:  # the folder belongs to the user who runs the code
            for path in (work, os.path.join(work, "main.py")):
                os.chown(path, drop_to, drop_to)
            os.chmod(root, 0o755)
        cpu_seconds = int(limits.timeout) + 2
        command = [*prefix, python, "-I", "-c", _BOOTSTRAP, str(limits.memory_bytes), str(cpu_seconds),
                   str(limits.max_file_bytes), str(drop_to), "1" if hook else "0"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # output goes to files outside the working folder (bounded by RLIMIT_FSIZE), never into this process's memory
        with open(os.path.join(root, "stdout"), "w+b") as out, open(os.path.join(root, "stderr"), "w+b") as err:
            try:
                process = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=err, start_new_session=True)
            except OSError as exc:
                return SandboxResult("", f"the sandbox could not start {python}: {exc}", 127, False)
            timed_out = False
            try:
                process.wait(timeout=limits.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)
            return SandboxResult(_read(out, limits.max_output_chars), _read(err, limits.max_output_chars, "tail"),
                                 process.returncode, timed_out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the code's process group (whatever it started too) and reap the process."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read(stream, max_chars: int, keep: str = "head") -> str:
    """At most `max_chars` characters of an output file: its beginning (stdout) or its end (stderr, where the
    exception is)."""
    size = os.fstat(stream.fileno()).st_size
    limit = 4 * max_chars  # enough bytes for max_chars characters of UTF-8
    stream.seek(0 if keep == "head" or size <= limit else size - limit)
    text = stream.read(limit).decode("utf-8", errors="replace")
    if size <= limit and len(text) <= max_chars:
        return text
    part = "first" if keep == "head" else "last"
    note = f"[output truncated: {size} bytes in all, the {part} {max_chars} characters shown]"
    return f"{text[:max_chars]}\n{note}" if keep == "head" else f"{note}\n{text[-max_chars:]}"


def python_tool_output(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model reads: the printed output; a timeout or a failure raises (counted by the executor)."""
    if result.timed_out:
        partial = f"\nOutput before it stopped:\n{result.stdout}" if result.stdout else ""
        raise ToolTimeout(f"the code ran past the time limit of {limits.timeout:g} s and was stopped{partial}")
    if result.returncode != 0:
        status = (f"was killed by signal {-result.returncode}" if result.returncode < 0
                  else f"exited with status {result.returncode}")
        raise ToolFailure(f"Error: the code {status}.\n{result.stdout}{result.stderr}".rstrip())
    return result.stdout if result.stdout else "(the code printed nothing; use print() to see values)"


DEFAULT_LIMITS = SandboxLimits()


@register_tool("python", timeout=DEFAULT_LIMITS.timeout + 20)
def python(code: str) -> str:
    """Run a Python program and return what it prints. Each call starts fresh: no variables carry over.

    Args:
        code: The complete program; print() the values you want to see.
    """
    return python_tool_output(run_python(code, DEFAULT_LIMITS), DEFAULT_LIMITS)
