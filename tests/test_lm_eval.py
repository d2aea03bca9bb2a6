"""lm-evaluation-harness against a real attnserve (the tiny GQA model on Ray Serve) through its
`local-completions` model, which scores each choice with echo + logprobs over the prompt, and against
lm-eval's own HF backend on the same checkpoint in fp32: the same accuracy, and each item's
loglikelihoods within 1e-3. The task is a local JSON file written here; nothing is fetched."""
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TASK = "attnserve_tiny_mc"
# (question, choices, answer): the tiny models' corpus (tests/tiny.py), so that some answers are likely
ITEMS = [
    ("The capital of France is", ["Paris", "London", "Rome", "blocks"], 0),
    ("The quick brown fox jumps over the", ["lazy dog", "cat", "moon", "tokens"], 0),
    ("Beautiful is better than", ["ugly", "nested", "dense", "Paris"], 0),
    ("Explicit is better than", ["implicit", "complex", "never", "dog"], 0),
    ("Simple is better than", ["complex", "ugly", "nested", "silenced"], 0),
    ("Flat is better than", ["nested", "dense", "implicit", "fox"], 0),
    ("Sparse is better than", ["dense", "flat", "complicated", "Rome"], 0),
    ("Now is better than", ["never", "always", "ugly", "values"], 0),
    ("Shall I compare thee to a summer's", ["day", "night", "dog", "rule"], 0),
    ("Keys and values are cached in blocks of sixteen", ["tokens", "days", "dogs", "rules"], 0),
    ("Attention is all you", ["need", "want", "have", "guess"], 0),
]

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return root


def evaluate(model: str, model_args: str, task_dir) -> tuple[float, dict[int, list[float]]]:
    """lm-eval's accuracy and, per item, the loglikelihood of each choice."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], num_fewshot=0, batch_size=1,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    samples = {s["doc_id"]: [float(ll) for ll, _ in s["filtered_resps"]] for s in out["samples"][TASK]}
    return out["results"][TASK]["acc,none"], samples


def test_lm_eval_through_local_completions_matches_its_hf_backend(serve_url, tiny_variants, task_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checkpoint = tiny_variants["tiny-gqa"]
    served_acc, served = evaluate(
        "local-completions", f"model=tiny-gqa,base_url={serve_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={checkpoint},tokenized_requests=True,max_retries=1,num_concurrent=1", task_dir)
    hf_acc, hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", task_dir)
    assert sorted(served) == sorted(hf) == list(range(len(ITEMS)))
    assert served_acc == hf_acc
    for doc_id, lls in hf.items():
        assert len(served[doc_id]) == len(lls) == 4
        assert max(abs(a - b) for a, b in zip(served[doc_id], lls)) < 1e-3, (doc_id, served[doc_id], lls)
    # the model's scores, not constants: they differ from choice to choice
    assert all(ll < 0 for lls in served.values() for ll in lls)
    assert len({round(ll, 3) for lls in served.values() for ll in lls}) > len(ITEMS)
