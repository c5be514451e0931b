"""The REST API's shared pieces: the /api/v1 router, strict pagination and query-parameter parsing.

Each app keeps its own serializers and viewsets in `<app>/api.py` (NetBox's shape); this package
only wires them together. To add endpoints, register the viewset in `console/api/urls.py`.
"""
