"""Incremental detokenisation: deltas add up to decode(); stop strings never leak across chunks."""
import random

import pytest

from server.engine.detokenizer import IncrementalDetokenizer
from tests.tiny import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def stream(tok, prompt, ids, stop=()):
    d = IncrementalDetokenizer(tok, prompt, stop)
    chunks, hit = [], None
    for i, t in enumerate(ids):
        hit = d.append(t)
        done = hit is not None or i == len(ids) - 1
        chunks.append(d.flush(done))
        if hit:
            break
    return chunks, hit


def test_deltas_add_up_to_decode_even_with_broken_utf8(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        chunks, _ = stream(tok, [5, 6], ids)
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)


def test_word_initial_spaces_survive(tok):
    prompt = tok("The capital of")["input_ids"]
    ids = tok(" France is Paris")["input_ids"]
    assert "".join(stream(tok, prompt, ids)[0]) == " France is Paris"


def test_stop_string_spanning_chunks_is_never_emitted(tok):
    ids = tok("Simple is better than complex. Flat is better")["input_ids"]
    chunks, hit = stream(tok, [], ids, stop=("than com",))
    assert hit == "than com"
    assert "".join(chunks) == "Simple is better "
    assert all("than" not in c for c in chunks)
