"""Common gRPC server plumbing shared by every MILI service."""
