"""Peak operator memory while Prometheus answers with hostile bodies (issue 15, class 4)."""
