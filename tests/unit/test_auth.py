"""Unit tests of asyncrpc.protocol.auth: the handshake's proofs, and the key's sources."""

from __future__ import annotations

import pytest

from asyncrpc.protocol import auth

KEY = b"k" * 32
D_NONCE, A_NONCE = b"d" * 32, b"a" * 32
DIALER, ACCEPTOR = ("w1", 1), ("w2", 2)


def proof(**changes: object) -> bytes:
    args: dict[str, object] = {
        "key": KEY,
        "role": auth.DIALER,
        "dialer_nonce": D_NONCE,
        "acceptor_nonce": A_NONCE,
        "dialer": DIALER,
        "acceptor": ACCEPTOR,
    }
    args.update(changes)
    return auth.proof(**args)  # type: ignore[arg-type]


def test_auth_proof_verifies_with_the_same_inputs() -> None:
    assert auth.verify(proof(), proof())
    assert len(proof()) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"key": b"x" * 32},
        {"role": auth.ACCEPTOR},  # a proof cannot be reflected back to its sender
        {"dialer_nonce": b"e" * 32},  # nor replayed on another connection
        {"acceptor_nonce": b"b" * 32},
        {"dialer": ("w3", 1)},  # nor moved to another claimed name
        {"dialer": ("w1", 3)},  # or rank
        {"acceptor": ("w2", 4)},
    ],
)
def test_auth_proof_changes_with_every_input(change: dict[str, object]) -> None:
    assert not auth.verify(proof(), proof(**change))


def test_auth_identity_encoding_is_unambiguous() -> None:
    # ("ab", 1) then ("c", 2) must not read the same as ("a", 1) then ("bc", 2).
    one = proof(dialer=("ab", 1), acceptor=("c", 2))
    other = proof(dialer=("a", 1), acceptor=("bc", 2))
    assert not auth.verify(one, other)


@pytest.mark.parametrize("received", [None, "text", b"", b"short", bytearray(32)])
def test_auth_verify_rejects_what_is_not_the_proof(received: object) -> None:
    assert not auth.verify(proof(), received)


def test_auth_key_from_option_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    assert auth.key_bytes(None) is None
    assert auth.key_bytes("secret") == b"secret"
    assert auth.key_bytes(b"\x00\x01") == b"\x00\x01"
    monkeypatch.setenv(auth.KEY_ENV, "from env")
    assert auth.key_bytes(None) == b"from env"
    assert auth.key_bytes("option wins") == b"option wins"
    with pytest.raises(ValueError, match="empty"):
        auth.key_bytes(b"")


def test_auth_nonces_and_keys_are_fresh() -> None:
    assert len({auth.new_nonce() for _ in range(100)}) == 100
    assert auth.new_key() != auth.new_key()
