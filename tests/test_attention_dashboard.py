"""/dashboard/attention in headless Chromium against a real HTTP server (uvicorn, the API's own app,
one engine process per model): it draws its example prompt on open, with nothing clicked, and a
windowed layer shows its band. Pixels are read back from Chromium's screenshot."""
import html
import re
import threading
import time
from urllib.parse import quote

import httpx
import numpy as np
import pytest

from loadtests.servers import free_port
from tests.test_observability_e2e import OUTPUT
from tests.tiny import WINDOW

# the first is the page's default; Mistral: every layer slides; Gemma 2: sliding / global alternating;
# Granite SWA: learned sinks on every layer
MODELS = {"tiny": "llama", "tiny-window": "mistral-window", "tiny-gemma2": "gemma2", "tiny-granite": "granite_swa"}
LONG_PROMPT = " ".join(str(i % 17) for i in range(40))  # past WINDOW tokens in the tiny tokenizer
BORDER = (221, 221, 221)  # the canvas's 1px #ddd border: where it lies in the screenshot
WHITE = (255, 255, 255)


@pytest.fixture(scope="module")
def page_url(tiny_checkpoints, variant_checkpoints):
    import uvicorn

    from server.engine import EngineConfig
    from server.http_app import create_app
    from server.model_client import LocalModelClient
    from server.openai_api import ApiLimits, OpenAIApi
    from server.worker import ModelWorker

    paths = {name: {**tiny_checkpoints, **variant_checkpoints}[arch] for name, arch in MODELS.items()}
    workers = {}
    try:
        for name, path in paths.items():
            workers[name] = ModelWorker(name, EngineConfig(model=str(path), dtype="float32", num_blocks=64,
                                                           block_size=4, max_model_len=256, enforce_eager=True))
        app = create_app(OpenAIApi({n: LocalModelClient(w) for n, w in workers.items()}, ApiLimits()))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.1)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    finally:
        for worker in workers.values():
            worker.shutdown()


def canvas_attrs(dom: str) -> dict[str, str]:
    canvas = re.search(r'<canvas id="heatmap"[^>]*>', dom).group(0)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', canvas))


def dom_of(chromium, url: str, tmp_path) -> tuple[str, dict[str, str]]:
    """The page as Chromium leaves it, and its canvas's data attributes."""
    res = chromium(f"--user-data-dir={tmp_path / 'dom'}", "--dump-dom", url)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout, canvas_attrs(res.stdout)


def pixels_of(chromium, url: str, tmp_path, name: str) -> np.ndarray:
    """The canvas's pixels (960 x 960 x RGB), cut out of Chromium's screenshot of the page."""
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / f"{name}.png"
    res = chromium(f"--user-data-dir={tmp_path / 'shot'}", f"--screenshot={shot}", url)
    assert res.returncode == 0, res.stderr[-2000:]
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    border = (image == BORDER).all(-1)
    rows, cols = np.nonzero(border.sum(1) >= 900)[0], np.nonzero(border.sum(0) >= 900)[0]
    assert len(rows) and len(cols), "no canvas border in the screenshot"
    assert rows.max() - rows.min() == cols.max() - cols.min() == 961, (rows, cols)  # 960 x 960 and its border
    y, x = rows.min() + 1, cols.min() + 1  # inside the border
    return image[y:y + 960, x:x + 960]


def grid(pixels: np.ndarray, attrs: dict[str, str]) -> np.ndarray:
    """(query, key, RGB) of each heatmap cell's centre pixel."""
    t, cell, left, top = (int(attrs[k]) for k in ("tokens", "cell", "left", "top"))
    centres = np.arange(t) * cell + cell // 2
    return pixels[top + centres[:, None], left + centres[None, :]]


def api_matrix(url: str, model: str, prompt: str, layer: int) -> np.ndarray:
    """(query, key): the API's weights of `layer`, the mean of its heads (the page's default view)."""
    r = httpx.post(f"{url}/v1/attention", json={"model": model, "prompt": prompt}, timeout=60)
    assert r.status_code == 200, r.text
    (chosen,) = [entry for entry in r.json()["layers"] if entry["layer"] == layer]
    return np.asarray(chosen["weights"], dtype=np.float64).mean(0)


def js_round(x: np.ndarray) -> np.ndarray:  # JavaScript's Math.round
    return np.floor(x + 0.5).astype(int)


def expected_cells(w: np.ndarray) -> np.ndarray:
    """(query, key, RGB) the page should draw: each weight over the largest, sqrt, white to blue."""
    v = np.sqrt(w / np.tril(w).max())
    return np.stack([js_round(255 - 225 * v), js_round(255 - 160 * v), js_round(255 - 60 * v)], -1)


def expected_sinks(w: np.ndarray) -> np.ndarray:
    """(query, RGB) of the sink column: its share, 1 - the row's sum, sqrt, white to orange."""
    v = np.sqrt(np.maximum(0, 1 - w.sum(-1)))
    return np.stack([js_round(255 - 20 * v), js_round(255 - 125 * v), js_round(255 - 200 * v)], -1)


def test_page_draws_its_example_prompt_on_open(page_url, tmp_path, chromium):
    """No query string, nothing clicked: the first model's heatmap of the example prompt is drawn."""
    url = f"{page_url}/dashboard/attention"
    dom, attrs = dom_of(chromium, url, tmp_path)
    t = int(attrs["tokens"])
    assert t > 2 and attrs["layer"] == "0" and attrs["head"] == "mean", attrs
    assert attrs["window"] == "" and attrs["sinks"] == "0" and attrs["sink-left"] == "", attrs  # no sink column
    assert 0 < float(attrs["max"]) <= 1, attrs
    assert re.search(rf'<div id="status">{t} tokens, 2 layers, 4 heads</div>', dom), dom[-3000:]
    assert "layer 0: global attention" in dom
    prompt = html.unescape(re.search(r'<textarea id="prompt">([^<]*)</textarea>', dom).group(1))
    pixels = pixels_of(chromium, url, tmp_path, "attention-on-open")
    assert (pixels != WHITE).any(-1).sum() > 20_000  # not a blank canvas
    cells, expected = grid(pixels, attrs), expected_cells(api_matrix(page_url, "tiny", prompt, 0))
    assert np.abs(cells - expected).max() <= 1  # each cell the API's weight, where it belongs
    below = np.tril(np.ones((t, t), dtype=bool))
    assert (cells[~below] == WHITE).all() and (cells[below] != WHITE).any(-1).mean() > 0.9


def test_windowed_layer_draws_its_band(page_url, tmp_path, chromium):
    """Every layer slides (window WINDOW): keys WINDOW or more back stay background, the band's far
    edge is outlined, and the layer is labelled with its window."""
    url = f"{page_url}/dashboard/attention?model=tiny-window&layer=1&prompt={quote(LONG_PROMPT)}"
    dom, attrs = dom_of(chromium, url, tmp_path)
    t = int(attrs["tokens"])
    assert t > WINDOW + 4 and attrs["layer"] == "1" and attrs["window"] == str(WINDOW), attrs
    assert f'<option value="0">0 (sliding window {WINDOW})</option>' in dom
    assert f"layer 1: sliding window {WINDOW}: keys {WINDOW} or more positions back weigh 0" in dom
    assert "with a sliding window" in re.search(r'<div id="status">([^<]*)</div>', dom).group(1)
    pixels = pixels_of(chromium, url, tmp_path, "attention-window")
    cells = grid(pixels, attrs)
    assert np.abs(cells - expected_cells(api_matrix(page_url, "tiny-window", LONG_PROMPT, 1))).max() <= 1
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    band = (k <= q) & (q - k < WINDOW)
    assert (cells[~band] == WHITE).all()  # past the window (and above the diagonal): background
    assert (~band & (k < q)).sum() > 50  # ... and there are such keys to look at
    assert (cells[band] != WHITE).any(-1).mean() > 0.9  # inside it, shaded
    cell, left, top = (int(attrs[n]) for n in ("cell", "left", "top"))
    for i in range(WINDOW, t):  # the edge: left of key i - WINDOW + 1 in row i, in orange
        r, g, b = pixels[top + i * cell + cell // 2, left + (i - WINDOW + 1) * cell - 1]
        assert r - b > 100 and r > g, (i, (r, g, b))


def test_alternating_layers_say_which_slides(page_url, tmp_path, chromium):
    """Gemma 2: layer 0 slides, layer 1 is global; each labelled, each drawn as such."""
    url = f"{page_url}/dashboard/attention?model=tiny-gemma2&prompt={quote(LONG_PROMPT)}"
    dom, attrs = dom_of(chromium, url, tmp_path)
    assert attrs["layer"] == "0" and attrs["window"] == str(WINDOW), attrs
    assert f'<option value="0">0 (sliding window {WINDOW})</option><option value="1">1 (global)</option>' in dom
    assert "(1 with a sliding window)" in dom
    dom, attrs = dom_of(chromium, f"{url}&layer=1", tmp_path)
    assert attrs["layer"] == "1" and attrs["window"] == "" and "layer 1: global attention" in dom, attrs
    t = int(attrs["tokens"])
    cells = grid(pixels_of(chromium, f"{url}&layer=1", tmp_path, "attention-global-layer"), attrs)
    assert np.abs(cells - expected_cells(api_matrix(page_url, "tiny-gemma2", LONG_PROMPT, 1))).max() <= 1
    below = np.tril(np.ones((t, t), dtype=bool))
    assert (cells[~below] == WHITE).all() and (cells[below] != WHITE).any(-1).mean() > 0.9  # the whole triangle


def test_sinks_share_is_a_column_left_of_key_0(page_url, tmp_path, chromium):
    """Learned sinks: a row sums to 1 minus the sink's share, drawn in a "sink" column of its own."""
    url = f"{page_url}/dashboard/attention?model=tiny-granite&layer=1&prompt={quote(LONG_PROMPT)}"
    dom, attrs = dom_of(chromium, url, tmp_path)
    assert attrs["sinks"] == "1" and attrs["window"] == str(WINDOW) and float(attrs["sink-max"]) > 0.01, attrs
    assert "sink column: the share the sink takes" in dom
    assert '<option value="0">0 (global)</option><option value="1">1 (sliding window 24)</option>' in dom
    t, cell, left, top, sink_left = (int(attrs[n]) for n in ("tokens", "cell", "left", "top", "sink-left"))
    assert sink_left + cell < left  # the column, then a gap, then key 0
    pixels = pixels_of(chromium, url, tmp_path, "attention-sinks")
    w = api_matrix(page_url, "tiny-granite", LONG_PROMPT, 1)
    assert np.abs(grid(pixels, attrs) - expected_cells(w)).max() <= 1
    rows = top + np.arange(t) * cell + cell // 2
    sink = pixels[rows, sink_left + cell // 2]  # (query, RGB)
    assert np.abs(sink - expected_sinks(w)).max() <= 1
    assert (sink != WHITE).any(-1).sum() > t // 2  # the sinks take a visible share of most rows
