"""Model files: a built-in's checksum is checked once per file as it lies, and a GGUF's tokenizer is built once."""

import hashlib
import os

import pytest
import transformers

from specdecode import models
from specdecode.models import Builtin, ModelError, builtin_gguf, gguf_tokenizer


def test_a_builtin_is_hashed_once_until_its_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    data = b"GGUF" + bytes(range(256)) * 64
    b = Builtin(name="fake", description="", packages=("json",), modules=("json",),  # "installed": json is there
                sha256=hashlib.sha256(data).hexdigest(), gguf_name="fake.gguf", vocab_size=1)
    path = tmp_path / "gguf" / "fake.gguf"
    path.parent.mkdir()
    path.write_bytes(data)
    hashed = []
    real_sha256 = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda p: hashed.append(p) or real_sha256(p))

    assert builtin_gguf(b) == path and len(hashed) == 1
    assert builtin_gguf(b) == path and len(hashed) == 1  # the same file: not hashed again

    path.write_bytes(data[:-1] + b"!")  # the same size, another content
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # and a later mtime, whatever the clock's grain
    with pytest.raises(ModelError, match="checksum mismatch"):
        builtin_gguf(b)
    assert len(hashed) == 2 and not path.exists()  # a bad assembled file is removed


@pytest.mark.models
def test_a_gguf_tokenizer_is_built_once_and_read_back_the_same(smol_q4_0, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    from_gguf = []
    real = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        from_gguf.append("gguf_file" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    built = gguf_tokenizer(smol_q4_0)
    cached = gguf_tokenizer(smol_q4_0)
    assert from_gguf == [True, False]  # the second one read the cached files, not the GGUF
    texts = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)", "  émoji 🙂 and\ttabs", ""]
    for text in texts:
        assert cached(text)["input_ids"] == built(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi"}]
    assert (cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (cached.eos_token, cached.bos_token, len(cached)) == (built.eos_token, built.bos_token, len(built))
