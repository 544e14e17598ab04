"""``snakellm serve`` on an imported Hugging Face model: the chat template that came with the model
(its tokenizer_config.json, kept with the run by ``snakellm import-hf``) renders the conversation
exactly as ``transformers``' ``apply_chat_template`` does, served from another working directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import env_with_venv
from hf_helpers import random_checkpoint, tokenizer_block
from serve_helpers import ServerProcess

pytestmark = pytest.mark.slow

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _cli(*args: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "snakellm.cli", *args], env=env_with_venv(), capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]


def test_imported_model_chat_uses_its_own_template(tmp_path):
    openai = pytest.importorskip("openai")
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    random_checkpoint(run, {}, tokenizer_block("gpt2-bpe"), seed=7)
    hf = tmp_path / "hf"
    _cli("export-hf", str(run), str(hf))
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHATML}))
    imported = tmp_path / "runs" / "imported"
    _cli("import-hf", str(hf), str(imported))
    assert json.loads((imported / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    server = ServerProcess(imported, "--quiet", cwd=elsewhere)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(model="imported", messages=msgs, max_tokens=6, temperature=0)
        prompt = transformers.AutoTokenizer.from_pretrained(str(hf)).apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True
        )
        assert prompt.endswith("<|im_start|>assistant\n")
        plain = client.completions.create(model="imported", prompt=prompt, max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == plain.choices[0].text
        assert (
            chat.usage.prompt_tokens
            == plain.usage.prompt_tokens
            == len(transformers.AutoTokenizer.from_pretrained(str(hf))(prompt)["input_ids"])
        )
    finally:
        server.stop()
