"""GET /audit pages are bounded in bytes; a bulk change's full before/after is read
page by page from GET /audit/{id}/changes."""

from __future__ import annotations

from fastapi.testclient import TestClient

from control_plane.audit.service import MAX_AUDIT_PAGE_BYTES


def test_audit_pages_are_bounded_and_bulk_changes_paged(client: TestClient) -> None:
    sent: list[dict[str, dict[str, object]]] = []
    for round_ in range(6):
        items = [
            {"user": f"user-{round_}-{i:05d}-" + "x" * 100, "output_tokens_per_second": round_ + 1}
            for i in range(1500)
        ]
        assert client.post("/limits:bulk", json={"items": items}).status_code == 200
        sent.append(
            {
                i["user"]: {
                    "tier": None,
                    "output_tokens_per_second": i["output_tokens_per_second"],
                    "scope": None,
                    "enforcement": None,
                    "ceiling_output_tokens_per_second": None,
                }
                for i in items
            }
        )
    assert client.put("/limits/small", json={"output_tokens_per_second": 3}).status_code == 200
    page = client.get("/audit?limit=1000")
    assert page.status_code == 200
    # Before: every bulk entry inline (6 x ~400 KB here; 27 MB after 30 imports of 10k).
    assert len(page.content) < MAX_AUDIT_PAGE_BYTES + 64 * 1024
    entries = page.json()["items"]
    while page.json()["next_before_id"] is not None:
        page = client.get(f"/audit?limit=1000&before_id={page.json()['next_before_id']}")
        assert len(page.content) < MAX_AUDIT_PAGE_BYTES + 64 * 1024
        entries += page.json()["items"]
    assert [e["version"] for e in entries] == list(range(7, 0, -1))
    assert entries[0]["truncated"] is False and entries[0]["after"] is not None
    bulks = [e for e in reversed(entries) if e["action"] == "bulk_put_limits"]
    assert all(e["truncated"] and e["after"] is None for e in bulks)
    for entry, expected in zip(bulks, sent, strict=True):
        after: dict[str, object] = {}
        cursor = None
        while True:
            url = f"/audit/{entry['id']}/changes?limit=400"
            r = client.get(url, params={"after": cursor} if cursor else None)
            assert r.status_code == 200
            assert len(r.content) < MAX_AUDIT_PAGE_BYTES
            for change in r.json()["items"]:
                assert change["before"] is None
                after[change["target"]] = change["after"]
            cursor = r.json()["next_after"]
            if cursor is None:
                break
        assert after == expected
    assert client.get("/audit/999999/changes").status_code == 404
