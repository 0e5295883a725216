"""Image content parts on the OpenAI-compatible chat routes.

- The local engine (text-only) refuses a request with images with a clear 400, through
  the real `openai` client, before anything is recorded.
- Network URLs, images outside user messages and bad data URLs are 400s naming the part.
- With SGLang (a mock worker on loopback that says it understands images and logs what
  it gets), the images travel as `image_data` data URLs beside ids that carry the
  template's placeholder, and each is stored once as a blob linked from the turn the
  request wrote.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn

from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import EngineRequestError
from agentflow.images import blob_id, data_url
from agentflow.inference.base import GenerateRequest, SamplingParams
from agentflow.inference.local import LocalEngine
from agentflow.inference.sglang import SGLangEngine, SGLangSettings
from agentflow.tokenization.chat import ByteChatTemplate
from tests.integration.agents.blackbox.conftest import TINY, Gateway
from tests.support.mock_sglang import WorkerState, create_mock_worker

pytestmark = pytest.mark.integration


def png() -> bytes:
    return b"\x89PNG\r\n\x1a\n" + os.urandom(200)


def look(*images: bytes, text: str = "What is on the screen?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": parts}


def client_for(gateway: Gateway, episode: uuid.UUID) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key(episode), max_retries=0)


def test_a_text_only_engine_refuses_images_before_recording(gateway, run_id, engine) -> None:
    assert gateway.call(engine.accepts_images()) is False
    with pytest.raises(EngineRequestError, match="does not accept images"):  # and if asked
        request = GenerateRequest(input_ids=(1,), image_data=(data_url(png()),))
        gateway.call(engine.generate(request))

    episode = gateway.new_episode(run_id)
    client = client_for(gateway, episode)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[look(png())], max_tokens=2)
    assert caught.value.status_code == 400
    assert "this engine does not accept images" in caught.value.message
    assert caught.value.body["param"] == "messages"  # type: ignore[index]
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()
    # A screenshot past the general 1 MiB body limit still reaches the chat route.
    big = png() + os.urandom(1_500_000)
    with pytest.raises(openai.BadRequestError, match="does not accept images"):
        client.chat.completions.create(model="m", messages=[look(big)], max_tokens=2)
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()
    # Text alone still works on the same episode.
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.choices[0].message is not None


def test_bad_image_parts_are_400_naming_the_part(gateway, run_id) -> None:
    episode = gateway.new_episode(run_id)
    client = client_for(gateway, episode)
    image = {"type": "image_url", "image_url": {"url": data_url(png())}}
    cases = [
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}],
                }
            ],
            "messages.0.content.0.image_url.url",
            "not fetched",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}
                    ],
                }
            ],
            "messages.0.content.0.image_url.url",
            "malformed",
        ),
        (
            [{"role": "system", "content": [image]}, {"role": "user", "content": "hi"}],
            "messages.0.content.0",
            "only user messages",
        ),
    ]
    for messages, param, reason in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert caught.value.body["param"] == param  # type: ignore[index]
        assert reason in caught.value.message
    assert gateway.call(gateway.turns.episode_tree(episode)).roots == ()


class ImageWorker:
    """A mock SGLang worker that understands images, on a loopback port (own thread)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        engine = LocalEngine.from_init(TINY, seed=0, max_batch_size=8)
        self.app = create_mock_worker(
            engine, model_path="tiny-vision", close_engine=True, image_understanding=True
        )
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),))
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the mock worker did not start")
            time.sleep(0.01)

    @property
    def state(self) -> WorkerState:
        return self.app.state.worker

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def sglang_run(gateway: Gateway) -> Iterator[tuple[uuid.UUID, ImageWorker]]:
    worker = ImageWorker()
    engine = SGLangEngine(SGLangSettings(url=worker.url))
    runtime = PolicyRuntime(
        engine=engine,
        template=ByteChatTemplate(),
        model_name="tiny-vision",
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        max_context=TINY.max_context,
    )
    yield gateway.new_run(runtime), worker
    gateway.call(engine.close())
    worker.stop()


def test_sglang_gets_the_images_and_each_is_stored_once(gateway, sglang_run) -> None:
    run_id, worker = sglang_run
    episode = gateway.new_episode(run_id)
    client = client_for(gateway, episode)
    first, second = png(), png()
    messages: list[dict[str, Any]] = [look(first, first)]  # the same image twice
    answer = client.chat.completions.create(model="m", messages=messages)
    sent = worker.state.log[-1]
    assert sent["image_data"] == [data_url(first), data_url(first)]
    placeholder = list(ByteChatTemplate().image_placeholder.encode())
    ids = sent["input_ids"]
    assert sum(ids[i : i + len(placeholder)] == placeholder for i in range(len(ids))) == 2

    # The agent goes on with its history (same images) and a new screenshot.
    messages += [answer.choices[0].message.model_dump(exclude_none=True), look(second, text="now?")]
    again = client.chat.completions.create(model="m", messages=messages)
    assert worker.state.log[-1]["image_data"] == [data_url(i) for i in (first, first, second)]

    turn_id = uuid.UUID(again.model_extra["agentflow"]["turn_id"])  # type: ignore[index]
    path = gateway.call(gateway.turns.path(turn_id))
    assert [(t.kind, t.images) for t in path] == [
        ("prompt", (blob_id(first), blob_id(first))),
        ("policy", ()),
        ("env", (blob_id(second),)),  # the history's images are not linked again
        ("policy", ()),
    ]
    # The engine saw exactly the stored context, placeholders included.
    context = gateway.call(gateway.turns.context(turn_id))
    assert worker.state.log[-1]["input_ids"] == list(context.token_ids[: -len(path[-1].token_ids)])
    info, data = gateway.call(gateway.turns.blob(blob_id(second)))
    assert (info.media_type, data) == ("image/png", second)
