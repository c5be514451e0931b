"""The Audit page: a filterable table of the chain, its verification badge, new entries live."""

from __future__ import annotations

from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.accounts.decorators import role_required
from console.accounts.roles import VIEWER
from console.api.params import QueryParams
from console.audit.api import FILTERS, filter_entries
from console.audit.live import entry_payload
from console.audit.models import AuditEntry, AuditHead

PAGE_ROWS = 200


@role_required(VIEWER)
def audit_page(request: HttpRequest) -> HttpResponse:
    q = QueryParams(request.GET, blank_is_absent=True)
    entries = filter_entries(q)
    # a page at a time, newest first; the next one starts below the last seq shown (keyset paging:
    # the table is kept whole, DESIGN.md invariant 7, so a page never scans what it does not show)
    page = [] if q.errors else list(entries[:PAGE_ROWS + 1])
    rows = [entry_payload(e) for e in page[:PAGE_ROWS]]
    older = None
    if len(page) > PAGE_ROWS:
        params = {name: request.GET[name] for name in FILTERS if request.GET.get(name) and name != "before_seq"}
        older = "?" + urlencode({**params, "before_seq": rows[-1]["seq"]})
    head = AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    types = list(AuditEntry.objects.order_by("event_type").values_list("event_type", flat=True).distinct())
    return render(request, "audit/audit.html", {
        "filters": {name: request.GET.get(name, "") for name in FILTERS},
        "errors": {name: "; ".join(reasons) for name, reasons in q.errors.items()},
        "page_data": {"entries": rows, "head_seq": head, "page_rows": PAGE_ROWS,
                      "filters": {name: request.GET.get(name, "") for name in FILTERS if request.GET.get(name)}},
        "event_types": types, "older": older, "paged": bool(request.GET.get("before_seq")),
    }, status=400 if q.errors else 200)
