"""The wire messages of cotrain's access protocol (the access check and the per-namespace handshake) and the
names of their handlers. Built at first use from a descriptor: no generated code to keep in step."""

from __future__ import annotations

import functools

CHECK_HANDLE = "cotrain.AccessCheck"  # answered by every full peer of a private swarm, token or not
HANDSHAKE = "cotrain.AccessHandshake"  # per averager namespace: binds a peer id to a token


@functools.cache
def messages():
    """The two protobuf messages of the access check and handshake, built at first use."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="cotrain_access.proto", package="cotrain", syntax="proto3")
    req = fdp.message_type.add(name="AccessRequest")
    for number, (name, kind) in enumerate(
        [
            ("token", f.TYPE_BYTES),
            ("time", f.TYPE_DOUBLE),
            ("nonce", f.TYPE_BYTES),
            ("signature", f.TYPE_BYTES),
        ],
        1,
    ):
        req.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    rep = fdp.message_type.add(name="AccessReply")
    for number, (name, kind) in enumerate(
        [
            ("granted", f.TYPE_BOOL),
            ("reason", f.TYPE_STRING),
            ("token", f.TYPE_BYTES),
            ("nonce", f.TYPE_BYTES),
            ("signature", f.TYPE_BYTES),
            ("revocations", f.TYPE_BYTES),  # a refusal for revocation: the authority's signed list, msgpack
        ],
        1,
    ):
        rep.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)

    class Messages:
        AccessRequest = message_factory.GetMessageClass(pool.FindMessageTypeByName("cotrain.AccessRequest"))
        AccessReply = message_factory.GetMessageClass(pool.FindMessageTypeByName("cotrain.AccessReply"))

    return Messages
