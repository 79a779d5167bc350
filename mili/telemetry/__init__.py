"""Observability: OpenTelemetry tracing (`tracing`) and Prometheus metrics (`metrics`)."""
