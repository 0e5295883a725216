"""Models: build a small HF Llama from a config, load and save HF-format checkpoints, score.

The embedded default cannot download weights, so it builds a randomly initialised
`LlamaForCausalLM` sized by `ModelInit`, with the project's byte-level tokenizer. Real
checkpoints are HF-format directories on local disk. `score` is the one teacher-forced
log-prob function that tests, the engine's consistency checks and the trainer share, so
"train" and "inference" log-probs are computed the same way.

torch and transformers are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentflow.errors import InvalidInput
from agentflow.integers import Int64

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# Written next to the weights so a saved model can be reloaded with its tokenizer kind.
MODEL_INIT_FILE = "agentflow_model_init.json"

_import_lock = threading.Lock()
_imported = False


def import_model_classes() -> None:
    """Import the transformers names engines and trainers use, once, under a lock.

    transformers resolves its top-level names lazily, and that first resolution is not
    thread-safe: two threads importing `LlamaForCausalLM` at once can each get an
    ImportError. Runs that start together (recovery after a crash) build their engines
    in parallel threads, so each build calls this first; afterwards the names are plain
    attributes and any thread may import them.
    """
    global _imported
    with _import_lock:
        if _imported:
            return
        import transformers
        from transformers.integrations import sdpa_attention  # noqa: F401

        for name in (
            "AttentionInterface",
            "AutoModelForCausalLM",
            "AutoTokenizer",
            "LlamaConfig",
            "LlamaForCausalLM",
            "PreTrainedModel",
        ):
            getattr(transformers, name)
        _imported = True


class ModelInit(BaseModel):
    """A small Llama built from scratch (random init), for CPU training and tests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: Int64 = Field(default=4, ge=1, le=128, description="decoder layers")
    hidden: Int64 = Field(default=128, ge=8, description="hidden size")
    heads: Int64 = Field(default=4, ge=1, description="attention heads")
    kv_heads: Int64 | None = Field(default=None, ge=1, description="KV heads (GQA); None: = heads")
    intermediate: Int64 | None = Field(
        default=None, ge=8, description="MLP width; None: 4 * hidden rounded to 8"
    )
    max_context: Int64 = Field(default=2048, ge=16, description="max positions (context length)")
    tokenizer: Literal["bytes"] = Field(
        default="bytes", description="only the project's byte-level tokenizer is built here"
    )
    rope_theta: float = Field(default=10000.0, gt=0)
    tie_embeddings: bool = Field(default=True, description="share input and output embeddings")

    @model_validator(mode="after")
    def _shapes(self) -> ModelInit:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({kv})")
        if (self.hidden // self.heads) % 2:
            raise ValueError("head dim (hidden / heads) must be even for rotary embeddings")
        return self

    @property
    def vocab_size(self) -> int:
        from agentflow.tokenization.bytes import ByteTokenizer

        return ByteTokenizer().vocab_size


def llama_config(init: ModelInit) -> Any:
    """The `LlamaConfig` for `init` (fp32, SDPA attention)."""
    from transformers import LlamaConfig

    from agentflow.tokenization.bytes import ByteTokenizer

    tok = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=init.hidden,
        intermediate_size=init.intermediate or (4 * init.hidden + 7) // 8 * 8,
        num_hidden_layers=init.layers,
        num_attention_heads=init.heads,
        num_key_value_heads=init.kv_heads or init.heads,
        max_position_embeddings=init.max_context,
        rope_parameters={"rope_type": "default", "rope_theta": init.rope_theta},
        tie_word_embeddings=init.tie_embeddings,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(init: ModelInit, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised `LlamaForCausalLM`; the same `seed` gives the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(init)
    # Seed only this construction (built on CPU), never the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config.agentflow_init = init.model_dump()
    return model.eval()


def load_model(path: str | Path, *, dtype: Any = None, device: str = "cpu") -> PreTrainedModel:
    """An HF-format causal LM from a local directory (never downloads)."""
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidInput(f"no HF model at {p} (config.json missing)", field="path")
    model = AutoModelForCausalLM.from_pretrained(
        p, local_files_only=True, dtype=dtype or torch.float32, attn_implementation="sdpa"
    )
    init_file = p / MODEL_INIT_FILE
    if init_file.is_file():
        model.config.agentflow_init = json.loads(init_file.read_text())
    model = model.to(device)  # type: ignore[arg-type]
    return model.eval()


def save_model(model: PreTrainedModel, path: str | Path) -> Path:
    """Save as safetensors + config (HF format), plus the `ModelInit` when there is one,
    and the tokenizer files (`save_tokenizer_files`)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(p, safe_serialization=True)
    init = getattr(model.config, "agentflow_init", None)
    if init is not None:
        (p / MODEL_INIT_FILE).write_text(json.dumps(init, indent=2))
    save_tokenizer_files(model, p)
    return p


# What a checkpoint's tokenizer is made of, in the files HF tools read.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def save_tokenizer_files(model: PreTrainedModel, path: str | Path) -> None:
    """Put the model's tokenizer beside its weights, so the directory loads alone with
    `AutoTokenizer.from_pretrained` (and serves with SGLang): the byte tokenizer as HF
    files for a model built from a `ModelInit`, else the files of the checkpoint it was
    loaded from."""
    p = Path(path)
    if tokenizer_kind(model) == "bytes":
        from agentflow.tokenization.hf_export import save_byte_tokenizer

        save_byte_tokenizer(p)
        return
    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if not source.is_dir() or source.resolve() == p.resolve():
        return
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, p / name)


def tokenizer_kind(model: PreTrainedModel) -> str | None:
    """`"bytes"` for models built from a `ModelInit`, else None (use the checkpoint's own)."""
    init = getattr(model.config, "agentflow_init", None)
    return init.get("tokenizer") if isinstance(init, dict) else None


def score(
    model: PreTrainedModel,
    token_ids: list[int],
    temperature: float = 1.0,
    *,
    start: int = 1,
) -> list[float]:
    """Teacher-forced log-prob of `token_ids[i]` given `token_ids[:i]`, for i in [start, n).

    Log-probs are of `log_softmax(logits / temperature)`, with temperature 0 meaning the
    unscaled `log_softmax(logits)`: the engine reports the same quantity, so the two are
    directly comparable.
    """
    import torch

    if start < 1 or start > len(token_ids):
        raise InvalidInput(f"start must be in [1, {len(token_ids)}], got {start}", field="start")
    if start == len(token_ids):
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].float()
    return token_logprobs(logits, ids[0, start:], temperature).tolist()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] row-wise; T == 0 uses the unscaled logits."""
    import torch

    scaled = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(scaled.float(), dim=-1)
    return logp.gather(-1, tokens.view(-1, 1).to(logp.device)).squeeze(-1)
