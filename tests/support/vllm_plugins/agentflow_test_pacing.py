"""A vLLM logits processor that paces the test server's steps on request.

Loaded into the tests' vLLM server (`--logits-processors
agentflow_test_pacing:PacingLogitsProcessor`, this folder on the server's `PYTHONPATH`).
While the file named by `AGENTFLOW_TEST_VLLM_PACE_FILE` exists, each decoding step
sleeps the seconds written in it, so a test can land an abort or a weight update in the
middle of an answer however slow the machine's control path is (a loaded API server can
take seconds to answer a scrape while the engine core decodes hundreds of tokens). The
logits pass through unchanged: the answers' tokens and log-probs are the model's.

It runs in vLLM's own venv and imports nothing of AgentFlow's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor


class PacingLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.pace_file = os.environ.get("AGENTFLOW_TEST_VLLM_PACE_FILE", "")

    def is_argmax_invariant(self) -> bool:
        return False  # so vLLM calls `apply` for greedy batches too

    def update_state(self, batch_update: Any) -> None:
        return None

    def apply(self, logits: Any) -> Any:
        if self.pace_file:
            try:
                with open(self.pace_file) as pace:
                    seconds = float(pace.read().strip() or 0)
            except (FileNotFoundError, ValueError):
                seconds = 0.0
            if seconds > 0:
                time.sleep(seconds)
        return logits
