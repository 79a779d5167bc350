"""A client that knows no generated stubs: it learns the API from server reflection, as grpcurl.

client = ReflectionClient(channel)
client.services()                       -> ["grpc.health.v1.Health", ...]
client.call_json("pkg.Service/Method", '{"field": 1}')  -> dict (unary)
client.stream_json("pkg.Service/Method", '{...}')       -> list[dict] (server streaming)
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


class ReflectionClient:
    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self._db)  # fed only by reflection

    def services(self) -> list[str]:
        return list(self._db.get_services())

    def method(self, full_method: str) -> MethodDescriptor:
        service, name = full_method.rsplit("/", 1)
        return self.pool.FindServiceByName(service).methods_by_name[name]

    def _callable(self, full_method: str, streaming: bool) -> tuple[Any, Any, Any]:
        method = self.method(full_method)
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        factory = self._channel.unary_stream if streaming else self._channel.unary_unary
        call = factory(
            f"/{full_method}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        return call, request_cls, response_cls

    def call_json(self, full_method: str, request_json: str, timeout: float = 30) -> dict:
        call, request_cls, _ = self._callable(full_method, streaming=False)
        response = call(json_format.Parse(request_json, request_cls()), timeout=timeout)
        return json.loads(json_format.MessageToJson(response))

    def stream_json(self, full_method: str, request_json: str, timeout: float = 60) -> list[dict]:
        call, request_cls, _ = self._callable(full_method, streaming=True)
        responses = call(json_format.Parse(request_json, request_cls()), timeout=timeout)
        return [json.loads(json_format.MessageToJson(r)) for r in responses]
