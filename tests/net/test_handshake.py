"""The proofs of a TCP connection between two ranks: each names one kind, job, round, pair and step."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.net.handshake import HELLO, PROOF_BYTES, Proofs, read_exact, read_into

fields = st.tuples(st.binary(min_size=1, max_size=8), st.sampled_from(["lane", "stream"]), st.text(max_size=4),
                   st.integers(0, 3), st.integers(0, 5), st.integers(0, 5), st.sampled_from(["hello", "answer"]))


@pytest.mark.pure
@given(fields, fields)
def test_a_proof_holds_only_for_what_it_was_made_for(one, other) -> None:
    key, kind, job, round_, a, b, what = one
    proof = Proofs(key, kind, job, round_).of(a, b, what)
    assert len(proof) == PROOF_BYTES
    assert Proofs(key, kind, job, round_).holds(proof, a, b, what)
    key2, kind2, job2, round2, a2, b2, what2 = other
    if (key2, kind2, job2, round2, a2, b2, what2) != one:
        assert not Proofs(key2, kind2, job2, round2).holds(proof, a2, b2, what2)


@pytest.mark.pure
def test_the_hello_carries_the_rank_and_the_key_stays_out_of_repr() -> None:
    proofs = Proofs(b"secret-key", "stream", "job", 1)
    rank, proof = HELLO.unpack(proofs.hello(3, 3, 0))
    assert rank == 3 and proofs.holds(proof, 3, 0, "hello") and not proofs.holds(proof, 0, 3, "hello")
    assert "secret-key" not in repr(proofs)


@pytest.mark.timeout(20)
def test_reads_tell_a_clean_end_from_a_cut_one() -> None:
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=lambda: (a.sendall(b"0123456789"), a.shutdown(socket.SHUT_WR))).start()
        assert read_exact(b, 4) == b"0123"
        with pytest.raises(ConnectionError, match="6 bytes into 10"):
            read_into(b, memoryview(bytearray(10)))
        assert not read_into(b, memoryview(bytearray(1)))
        with pytest.raises(ConnectionError, match="closed during the handshake"):
            read_exact(b, 1)
