"""Generated from protos/ by scripts/gen_protos.py; do not edit."""
