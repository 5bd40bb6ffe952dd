"""Listing incomplete multipart uploads page by page. PagedStore is a test double for S3 (not a
profd part): moto's server never truncates this listing, so paging cannot be tried against it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from profd.store import s3


class PagedStore:
    """Answers ListMultipartUploads as S3 does: sorted by key then upload id, ``page`` at a
    time, resuming after (KeyMarker, UploadIdMarker)."""

    def __init__(self, uploads: list[tuple[str, str]], page: int, stuck: bool = False) -> None:
        self.uploads = sorted(uploads)
        self.page = page
        self.stuck = stuck  # a store that says "truncated" and never moves its markers
        self.calls: list[dict[str, Any]] = []

    def list_multipart_uploads(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        after = (kw.get("KeyMarker", ""), kw.get("UploadIdMarker", ""))
        left = [u for u in self.uploads if u[0].startswith(kw["Prefix"]) and u > after]
        if not kw.get("UploadIdMarker"):  # a key marker alone skips that key entirely
            left = [u for u in left if u[0] > after[0]]
        got = left[: self.page]
        at = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
        resp: dict[str, Any] = {
            "Uploads": [{"Key": k, "UploadId": i, "Initiated": at} for k, i in got],
            "IsTruncated": len(left) > self.page,
        }
        if resp["IsTruncated"]:
            last = self.uploads[0] if self.stuck else got[-1]
            resp["NextKeyMarker"], resp["NextUploadIdMarker"] = last
        return resp


def test_every_page_is_read_including_uploads_of_one_key_across_pages() -> None:
    ups = [("p/a", "1"), ("p/a", "2"), ("p/a", "3"), ("p/b", "1"), ("p/c", "9"), ("q/x", "1")]
    store = PagedStore(ups, page=2)
    got = list(s3.open_uploads(store, "bkt", "p/"))
    assert [(u.key, u.upload_id) for u in got] == ups[:5]
    assert len(store.calls) == 3
    assert store.calls[1]["KeyMarker"] == "p/a" and store.calls[1]["UploadIdMarker"] == "2"
    assert all(u.initiated == dt.datetime(2024, 1, 1, tzinfo=dt.UTC).timestamp() for u in got)


def test_a_store_whose_markers_do_not_move_is_not_listed_forever() -> None:
    ups = [("p/a", str(i)) for i in range(10)]
    store = PagedStore(ups, page=2, stuck=True)
    got = list(s3.open_uploads(store, "bkt", "p/"))
    assert len(store.calls) == 2 and len(got) == 4
