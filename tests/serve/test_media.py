"""Images in HTTP requests (serve/media.py): data: URLs, SGLang's bare base64, local files only
under vision.media_root, never a network fetch, one clear 400 for each bad input; chat content
parts checked and rendered as Qwen's placeholders."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("fastapi")

from bi_core.serve import media  # noqa: E402
from bi_core.serve.api_errors import ApiError  # noqa: E402


def png(h: int = 12, w: int = 20, seed: int = 0) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_data_url_base64_and_files_under_the_root(tmp_path):
    raw = png()
    want = media.decode_image(data_url(raw), None, "p")
    assert want.shape == (12, 20, 3) and want.dtype == np.uint8
    assert np.array_equal(media.decode_image(base64.b64encode(raw).decode(), None, "p"), want)
    (tmp_path / "a.png").write_bytes(raw)
    assert np.array_equal(media.decode_image("a.png", str(tmp_path), "p"), want)
    assert np.array_equal(media.decode_image(f"file://{tmp_path / 'a.png'}", str(tmp_path), "p"), want)


@pytest.mark.parametrize("value,message", [
    ("https://example.com/cat.png", "not fetched from the network"),
    ("http://10.0.0.1/x.jpg", "not fetched from the network"),
    ("data:text/plain;base64,aGk=", "not fetched from the network"),
    ("not base64 at all!", "neither a data: URL, base64, nor a local file path"),
    (data_url(b"not an image"), "cannot be decoded"),
    (12, "non-empty string"),
])
def test_refusals(value, message):
    with pytest.raises(ApiError, match=message) as e:
        media.decode_image(value, None, "messages[0].content[1].image_url.url")
    assert e.value.status == 400 and e.value.body["error"]["param"] == "messages[0].content[1].image_url.url"


def test_local_files_need_the_root_and_stay_inside_it(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(png())
    with pytest.raises(ApiError, match="no vision.media_root"):
        media.decode_image("secret.png", None, "p")
    for path in ("../secret.png", str(tmp_path / "secret.png"), f"file://{tmp_path / 'secret.png'}"):
        with pytest.raises(ApiError, match="outside vision.media_root"):
            media.decode_image(path, str(root), "p")
    with pytest.raises(ApiError, match="no image file"):
        media.decode_image("missing.png", str(root), "p")


def test_chat_parts():
    media.check_part({"type": "text", "text": "hi"})
    media.check_part({"type": "image_url", "image_url": {"url": "data:..."}})
    media.check_part({"type": "video", "video": ["a", "b", "c"]})
    for bad in ({"type": "audio"}, {"type": "video", "video": []}, {"type": "text"}, "x"):
        with pytest.raises(ValueError, match="content parts are"):
            media.check_part(bad)
    assert media.part_text({"type": "image_url", "image_url": "u"}) == media.IMAGE_PLACEHOLDER
    # three frames: two groups of two (the last frame repeated), at the processor's timestamps
    assert media.part_text({"type": "video", "video": [1, 2, 3]}) == (
        f"<0.2 seconds>{media.VIDEO_PLACEHOLDER}<1.0 seconds>{media.VIDEO_PLACEHOLDER}")
    images, videos = media.chat_media(["text only", [{"type": "text", "text": "a"},
                                                     {"type": "image_url", "image_url": {"url": data_url(png())}},
                                                     {"type": "video", "video": [data_url(png(seed=1))] * 2}]], None)
    assert len(images) == 1 and len(videos) == 1 and len(videos[0]) == 2


def test_sglang_image_data_per_prompt():
    url = data_url(png())
    one = media.sglang_media(url, None, 1, None)
    assert len(one[0]["images"]) == 1 and one[0]["videos"] is None
    batch = media.sglang_media([[url, url], None], None, 2, None)
    assert len(batch[0]["images"]) == 2 and batch[1]["images"] is None
    with pytest.raises(ApiError, match="one image_data entry per prompt"):
        media.sglang_media([url], None, 2, None)
    vid = media.sglang_media(None, [url, url], 1, None)
    assert len(vid[0]["videos"]) == 1 and len(vid[0]["videos"][0]) == 2


def test_a_server_without_a_tower_refuses_images_before_decoding():
    with pytest.raises(ApiError, match="takes no images") as e:
        media.sglang_media("not even base64", None, 1, None, takes_images=False)
    assert e.value.body["error"]["param"] == "image_data"
    with pytest.raises(ApiError, match="takes no images") as e:
        media.chat_media(["x", [{"type": "image_url", "image_url": "junk"}]], None, takes_images=False)
    assert e.value.body["error"]["param"] == "messages[1].content"
    assert media.chat_media([[{"type": "text", "text": "only text"}]], None, takes_images=False) == ([], [])
