"""Whether llama.cpp may load weights into its extra buffer types here: vetted once per build x CPU x GGUF format.

llama.cpp's fastest CPU kernels run on weights repacked into "extra buffer types" (AMX tiles on Intel Xeons,
CPU_REPACK's interleaved layouts elsewhere). A bad kernel there kills the process with a signal that no Python code
can catch: the pinned llama.cpp's AMX kernels did on Sapphire Rapids class Xeons (patches/llama-cpp/ fixes that one).
So before the first load of a combination not yet vetted, a child process (llamaprobe.py) loads the file and decodes
a few tokens; if it dies by a signal, models load with extra buffer types off, and one line says so. The verdict is
cached under the cache dir; SPECDECODE_LLAMA_EXTRA_BUFFERS=0|1 overrides it either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .base import BackendError

ENV = "SPECDECODE_LLAMA_EXTRA_BUFFERS"
PROBE = Path(__file__).with_name("llamaprobe.py")
PROBE_TIMEOUT_S = 300  # loading a large GGUF from a cold disk, and repacking it, can take minutes


@dataclass(frozen=True)
class Verdict:
    extra_buffers: bool
    why: str  # "forced by SPECDECODE_LLAMA_EXTRA_BUFFERS", "probe passed", "probe died by SIGSEGV", ...
    buffers: tuple[str, ...] = ()  # what the probe's load used (empty when not probed)


def cpu_identity() -> str:
    """The CPU's model name and feature flags: what decides which kernels llama.cpp runs."""
    name = flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return f"{name}|{flags}"


def build_identity() -> str:
    """llama-cpp-python's version and its native libraries (name, size, mtime): a rebuild is a new build."""
    import llama_cpp

    root = Path(llama_cpp.__file__).parent
    libs = sorted(p for p in root.rglob("*") if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name)
    return llama_cpp.__version__ + "".join(f"|{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in libs)


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def gguf_format(path: Path) -> str:
    """The file's architecture and file type ("llama:ftype=3"), read from the start of its metadata: the `general.*`
    keys come first, so this reads a few KB (the gguf package's reader maps the whole vocabulary: ~5 s)."""
    import struct

    wanted = {"general.architecture": "?", "general.file_type": "?"}
    with open(path, "rb") as f:
        magic, _version, _tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise BackendError(f"{path} is not a GGUF file")

        def string() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode(errors="replace")

        def skip(kind: int) -> None:
            if kind == _STRING:
                f.seek(struct.unpack("<Q", f.read(8))[0], 1)
            elif kind == _ARRAY:
                inner, count = struct.unpack("<IQ", f.read(12))
                if inner in _SCALAR_SIZES:
                    f.seek(count * _SCALAR_SIZES[inner], 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_SCALAR_SIZES[kind], 1)

        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == _STRING:
                wanted[key] = string()
            elif key == "general.file_type" and kind == _UINT32:
                wanted[key] = str(struct.unpack("<I", f.read(4))[0])
            else:
                skip(kind)
            if "?" not in wanted.values():
                break
    return f"{wanted['general.architecture']}:ftype={wanted['general.file_type']}"


def _verdict_file(path: Path) -> Path:
    from ..models import cache_dir

    key = hashlib.sha256(f"{build_identity()}\n{cpu_identity()}\n{gguf_format(path)}".encode()).hexdigest()[:24]
    return cache_dir() / "llama-vetted" / f"{key}.json"


def forced() -> bool | None:
    value = os.environ.get(ENV)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise BackendError(f"{ENV} must be 0 (extra buffer types off) or 1 (on), got {value!r}")
    return value == "1"


def vet(path: str | Path, probe: list[str] | None = None) -> Verdict:
    """The verdict for loading this GGUF here: the override, the cached verdict, or a fresh probe (`probe`: the
    child's command, for tests; default: llamaprobe.py on the file)."""
    path = Path(path)
    known = known_verdict(path)
    if known is not None:
        return known
    verdict = _probe(path, probe or [sys.executable, str(PROBE), str(path)])
    if verdict is None:
        return Verdict(True, "probe inconclusive (not cached)")
    cached = _verdict_file(path)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(verdict)))
    tmp.replace(cached)
    return verdict


def known_verdict(path: str | Path) -> Verdict | None:
    """The verdict already known for this file here (the override or the cache), without probing."""
    override = forced()
    if override is not None:
        return Verdict(override, f"forced by {ENV}={int(override)}")
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(_verdict_file(Path(path)).read_text())
        return Verdict(bool(data["extra_buffers"]), data["why"], tuple(data.get("buffers", ())))
    return None


def _probe(path: Path, command: list[str]) -> Verdict | None:
    """Run the child; None when it neither passed nor died by a signal (an ordinary load error, which the real load
    will report in its own words, or a time-out)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else str(-done.returncode)
        print(f"[specdecode] llama.cpp's optimized weight layouts (AMX / CPU_REPACK) crashed a test decode of {path.name} "
              f"on this CPU ({name}): loading it with them off (plain CPU kernels: slower, ~20 % in decoding on an AMX "
              f"Xeon); {ENV}=1 forces them on", file=sys.stderr)
        return Verdict(False, f"probe died by {name}")
    if done.returncode != 0:
        return None
    try:
        buffers = tuple(json.loads(done.stdout.strip().splitlines()[-1])["buffers"])
    except (ValueError, KeyError, IndexError):
        buffers = ()
    return Verdict(True, "probe passed", buffers)


@contextlib.contextmanager
def default_params_for(lib, path: str | Path):
    """While inside, llama-cpp-python's `llama_model_default_params()` gives this file's vetted params: for loaders
    that build their own params (llama-cpp-python's `Llama`, used by the bench's llama-cpp baseline)."""
    verdict = vet(path)
    original = lib.llama_model_default_params

    def vetted():
        params = original()
        params.use_extra_bufts = verdict.extra_buffers
        return params

    modules = [m for m in (sys.modules.get("llama_cpp"), sys.modules.get("llama_cpp.llama_cpp")) if m is not None]
    for module in modules:
        module.llama_model_default_params = vetted
    try:
        yield verdict
    finally:
        for module in modules:
            module.llama_model_default_params = original
