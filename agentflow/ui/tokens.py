"""Each token's text, for showing a turn token by token.

The run's tokenizer comes from its live runtime when the run is live, else it is built
from the run's stored config (a byte tokenizer for models this project built, the
checkpoint's own for a checkpoint). One that cannot be built (the checkpoint moved) means
the dashboard shows token ids alone; it never fails the page.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from agentflow.agents.runtime import RuntimeRegistry
from agentflow.tokenization import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

# Tokenizers of finished runs kept at once (an HF one is some megabytes).
_KEPT = 8


class TokenTexts:
    def __init__(self, runtimes: RuntimeRegistry) -> None:
        self._runtimes = runtimes
        self._built: OrderedDict[uuid.UUID, Tokenizer | None] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self, run_id: uuid.UUID | None, config: Mapping[str, Any]) -> Tokenizer | None:
        if run_id is not None and run_id in self._runtimes:
            return self._runtimes.get(run_id).template.tokenizer
        key = run_id or uuid.UUID(int=0)
        with self._lock:  # called from worker threads (building one may read files)
            if key in self._built:
                self._built.move_to_end(key)
                return self._built[key]
        tokenizer = _build(config)
        with self._lock:
            self._built[key] = tokenizer
            if len(self._built) > _KEPT:
                self._built.popitem(last=False)
        return tokenizer

    @staticmethod
    def texts(tokenizer: Tokenizer | None, token_ids: Sequence[int]) -> list[str] | None:
        """Each token decoded alone. A byte token that is only part of a UTF-8 character
        shows as its byte (`<0xE2>`), not as a replacement character."""
        if tokenizer is None:
            return None
        if isinstance(tokenizer, ByteTokenizer):
            return [
                f"<0x{token:02X}>" if 0x80 <= token < 0x100 else tokenizer.decode([token])
                for token in token_ids
            ]
        return [tokenizer.decode([token]) for token in token_ids]


def _build(config: Mapping[str, Any]) -> Tokenizer | None:
    from agentflow.inference.factory import build_template
    from agentflow.run_config import RunConfig

    try:
        return build_template(RunConfig.model_validate(dict(config))).tokenizer
    except Exception as exc:  # noqa: BLE001 - ids instead of texts, and the page shows
        log.warning("no tokenizer for the dashboard: %s", exc)
        return None
