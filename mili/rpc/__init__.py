"""Common gRPC plumbing shared by every MILI service: the server (`server`, `interceptor`,
`policy`, `malformed`, `heap`), statuses with details (`status`), channels (`client`, `tls`,
`certs`) and the messages every service converts the same way (`kv_layout`, `sampling`,
`prefix_cache`); docs/architecture.md describes each.

Nothing is imported here: a module that needs one of them (kv_layout, say) loads only it.
"""
