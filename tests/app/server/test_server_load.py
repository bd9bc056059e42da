"""A bounded load test of the local server: 8 streaming clients × 5 requests at once, each
asking its own question; every stream's text must equal that question's non-streamed
temperature-0 reply (no cross-talk between concurrent requests, nothing lost or repeated)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from app.session_setup import DEMO_MODEL_ID

pytestmark = pytest.mark.slow

CLIENTS, REQUESTS = 8, 5
QUESTIONS = [
    "What sound does a cow make?",
    "What sound does a dog make?",
    "What sound does a cat make?",
    "What sound does a sheep make?",
    "Tell me a story about a horse.",
    "Tell me a story about a pig.",
    "What do cows eat?",
    "Where do sheep live?",
]


def ask(client, question: str, stream: bool) -> str:
    messages = [{"role": "user", "content": question}]
    if not stream:
        reply = client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=messages, temperature=0, max_tokens=48
        )
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=messages, temperature=0, max_tokens=48, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_streaming_clients_each_get_their_own_reply(live):
    client = live.client(timeout=300)
    expected = {q: ask(client, q, stream=False) for q in QUESTIONS}
    assert len(set(expected.values())) > 4, "the questions must have different answers to show cross-talk"

    def one_client(question: str) -> list[str]:
        own = live.client(timeout=300)
        return [ask(own, question, stream=True) for _ in range(REQUESTS)]

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = dict(zip(QUESTIONS, pool.map(one_client, QUESTIONS), strict=True))
    for question, texts in results.items():
        assert texts == [expected[question]] * REQUESTS, question
