"""Pub/Sub clients can be made with PUBSUB_EMULATOR_HOST set (the documented default)."""

from google.cloud import pubsub_v1

from async_processor.backends.pubsub import make_clients


def test_clients_with_the_emulator_variable_set(monkeypatch):
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    for host in ("", "127.0.0.1:2"):
        publisher, subscriber = make_clients(host)
        assert isinstance(publisher, pubsub_v1.PublisherClient)
        assert isinstance(subscriber, pubsub_v1.SubscriberClient)
