"""OpenAI-compatible request entry (DESIGN.md: console/gateway): routes to plans, survives switches."""
