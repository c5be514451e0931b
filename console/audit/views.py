"""The Audit page: a filterable table of the chain, its verification badge, new entries live."""

from __future__ import annotations

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
    rows = [] if q.errors else [entry_payload(e) for e in entries[:PAGE_ROWS]]
    head = AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    types = list(AuditEntry.objects.order_by("event_type").values_list("event_type", flat=True).distinct())
    return render(request, "audit/audit.html", {
        "filters": {name: request.GET.get(name, "") for name in FILTERS},
        "errors": {name: "; ".join(reasons) for name, reasons in q.errors.items()},
        "page_data": {"entries": rows, "head_seq": head, "page_rows": PAGE_ROWS,
                      "filters": {name: request.GET.get(name, "") for name in FILTERS if request.GET.get(name)}},
        "event_types": types,
    }, status=400 if q.errors else 200)
