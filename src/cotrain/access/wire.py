"""The wire messages of cotrain's access protocol (the access check and the per-namespace handshake) and the
names of their handlers. Built at first use from a descriptor: no generated code to keep in step."""

from __future__ import annotations

import functools

CHECK_HANDLE = "cotrain.AccessCheck"  # answered by every full peer of a private swarm, token or not
HANDSHAKE = "cotrain.AccessHandshake"  # per averager namespace: binds a peer id to a token


def build_messages(file_name: str, specs: dict[str, list[tuple[str, str]]]) -> type:
    """Protobuf message classes built from a descriptor: ``specs`` maps each message's name (package
    ``cotrain``) to its fields, in order, as (name, type) with type one of "bytes", "bool", "string",
    "double"; returns a class with each message class as an attribute of its name."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    kinds = {"bytes": f.TYPE_BYTES, "bool": f.TYPE_BOOL, "string": f.TYPE_STRING, "double": f.TYPE_DOUBLE}
    fdp = descriptor_pb2.FileDescriptorProto(name=file_name, package="cotrain", syntax="proto3")
    for message, fields in specs.items():
        added = fdp.message_type.add(name=message)
        for number, (name, kind) in enumerate(fields, 1):
            added.field.add(name=name, number=number, type=kinds[kind], label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    classes = {
        message: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"cotrain.{message}"))
        for message in specs
    }
    return type("Messages", (), classes)


@functools.cache
def messages():
    """The two protobuf messages of the access check and handshake, built at first use."""
    return build_messages(
        "cotrain_access.proto",
        {
            "AccessRequest": [
                ("token", "bytes"),
                ("time", "double"),
                ("nonce", "bytes"),
                ("signature", "bytes"),
            ],
            # revocations: a refusal for revocation carries the authority's signed list, msgpack
            "AccessReply": [
                ("granted", "bool"),
                ("reason", "string"),
                ("token", "bytes"),
                ("nonce", "bytes"),
                ("signature", "bytes"),
                ("revocations", "bytes"),
            ],
        },
    )
