"""Encryption at rest: AES-256-GCM of chunk values, a key per tenant, one master key file.

A persistent or shared tier with encryption on seals each value before it leaves the
process: ``nonce (12 B) || ciphertext || tag (16 B)``, the chunk key as associated data
(so a value moved to another key's slot fails its tag). The AES key of a chunk is
derived with HKDF-SHA256 from the master key and the tenant tag the chunk key carries
(:mod:`kvtier.store.quota`): tenants never share an AES key, so one tenant's values
cannot be opened with another's. Every read verifies the tag; a value that fails is
:class:`~kvtier.errors.CorruptChunkError` (a miss and a counted corruption), never bytes.

Nonces are random (96 bits): with a key per tenant, each key seals far fewer values in
a tier's lifetime than the 2^32 that random GCM nonces allow.

The master key file holds 32 random bytes in hex (mode 0600), made on first start under
the data directory, or given by path. A tier records a check value sealed under the key
it first ran with, so a restart with another key (or a lost key file) is a
:class:`~kvtier.errors.ConfigError` at start, not a tier that serves only misses.

``cryptography`` is an optional dependency (``pip install 'kvtier[crypto]'``), imported
only where encryption is on.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, CorruptChunkError
from kvtier.files import make_private_dirs

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG
"""Bytes a sealed value takes beyond the value itself."""
_INFO = b"kvtier/at-rest/v1\0"
_KEY_ID_INFO = b"kvtier/at-rest/key-id/v1"
_CHECK = b"kvtier master key check"
_CACHE = 4096  # derived keys kept; tenants are few, untagged keys get one per prefix


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise ConfigError(
            "encryption.enabled",
            True,
            "the cryptography package (pip install 'kvtier[crypto]')",
        ) from exc
    return AESGCM


def load_master_key(path: Path, *, create: bool, key: str = "encryption.key_file") -> bytes:
    """The 32-byte master key in ``path``; with ``create``, a new one (mode 0600) when
    the file is absent.

    Raises:
        ConfigError: the file is missing (and not ``create``), unreadable, not private
            (readable by group or others), or not 64 hex digits.
    """
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        if not create:
            raise ConfigError(key, str(path), "an existing master key file") from None
        make_private_dirs(path.parent)
        master = secrets.token_bytes(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(master.hex() + "\n")
        except OSError as exc:
            raise ConfigError(key, str(path), f"a writable master key file ({exc})") from exc
        return master
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, str(path), f"a readable master key file ({exc})") from exc
    if path.stat().st_mode & 0o077:
        raise ConfigError(key, str(path), "a master key file of mode 0600 (chmod 600 it)")
    try:
        master = bytes.fromhex(text)
    except ValueError:
        master = b""
    if len(master) != 32:
        raise ConfigError(key, str(path), "64 hex digits (a 256-bit key)")
    return master


class Cipher:
    """Seals and opens chunk values with AES-256-GCM, a key per tenant tag. Thread-safe.

    Args:
        master: the 32-byte master key.
    """

    def __init__(self, master: bytes) -> None:
        self._aes = _aesgcm()
        self._master = master
        self._keys: dict[bytes, Any] = {}
        self._lock = threading.Lock()
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        # Names the master key without revealing it (HKDF output under its own info is
        # independent of the AES keys): a shared tier keeps values sealed under
        # different master keys apart by it (kvtier.tiers.redis).
        self.key_id = HKDF(hashes.SHA256(), 8, salt=None, info=_KEY_ID_INFO).derive(master).hex()

    def _for(self, tag: bytes) -> Any:
        aead = self._keys.get(tag)
        if aead is None:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF

            derived = HKDF(hashes.SHA256(), 32, salt=None, info=_INFO + tag).derive(self._master)
            aead = self._aes(derived)
            with self._lock:
                if len(self._keys) >= _CACHE:
                    self._keys.clear()
                self._keys[tag] = aead
        return aead

    overhead = OVERHEAD

    def seal_into(self, key: bytes, value: Any, out: memoryview) -> None:
        """:meth:`seal` written into ``out`` (exactly the value's length plus
        :data:`OVERHEAD`), with no copy of the value."""
        nonce = os.urandom(NONCE)
        out[:NONCE] = nonce
        self._for(key[:4]).encrypt_into(nonce, value, key, out[NONCE:])

    def open_into(self, key: bytes, sealed: Any, out: memoryview) -> None:
        """:meth:`open` written into ``out`` (exactly the value's length).

        Raises:
            CorruptChunkError: as :meth:`open`; ``out`` may then hold garbage.
        """
        from cryptography.exceptions import InvalidTag

        buf = memoryview(sealed).cast("B")
        if buf.nbytes != out.nbytes + OVERHEAD:
            raise CorruptChunkError("sealed value of the wrong length")
        try:
            self._for(key[:4]).decrypt_into(buf[:NONCE], buf[NONCE:], key, out)
        except InvalidTag:
            raise CorruptChunkError("sealed value fails its authentication tag") from None

    def seal(self, key: bytes, value: Any) -> bytes:
        """``value`` sealed for chunk ``key``: nonce || ciphertext || tag."""
        nonce = os.urandom(NONCE)
        return nonce + bytes(self._for(key[:4]).encrypt(nonce, value, key))

    def open(self, key: bytes, sealed: Any) -> bytes:
        """The value sealed for chunk ``key``.

        Raises:
            CorruptChunkError: the tag does not verify (altered bytes, another chunk's
                value, another tenant's or another master key's).
        """
        from cryptography.exceptions import InvalidTag

        buf = memoryview(sealed).cast("B")
        if buf.nbytes < OVERHEAD:
            raise CorruptChunkError("sealed value shorter than its nonce and tag")
        try:
            out = self._for(key[:4]).decrypt(buf[:NONCE], buf[NONCE:], key)
        except InvalidTag:
            raise CorruptChunkError("sealed value fails its authentication tag") from None
        return bytes(out)

    def check_value(self) -> bytes:
        """A value sealed under this master key, kept by a tier to recognise it."""
        return self.seal(bytes(16), _CHECK)

    def matches(self, check: bytes) -> bool:
        """Whether ``check`` (a :meth:`check_value`) was sealed under this master key."""
        try:
            return self.open(bytes(16), check) == _CHECK
        except CorruptChunkError:
            return False


def cipher_of(key_file: str, where: str) -> Cipher | None:
    """The cipher of a tier's ``encryption_key_file`` option (which must exist); None
    when it is empty (encryption off)."""
    if not key_file:
        return None
    path = Path(key_file).expanduser()
    return Cipher(load_master_key(path, create=False, key=f"{where}.encryption_key_file"))


def check_key_file(path: Path, cipher: Cipher | None, where: str) -> None:
    """Refuse to start a tier whose chunks were sealed under another master key, or
    are sealed while encryption is off; record this key's check value in ``path`` (the
    tier's own directory) on its first start with encryption.

    Raises:
        ConfigError: named ``<where>.encryption_key_file``.
    """
    key = f"{where}.encryption_key_file"
    try:
        check = path.read_bytes()
    except FileNotFoundError:
        check = None
    if check is not None and cipher is None:
        raise ConfigError(
            key, "", f"the master key file the chunks in {path.parent} are sealed with"
        )
    if check is not None and cipher is not None and not cipher.matches(check):
        raise ConfigError(
            key, "<another key>", f"the master key file the chunks in {path.parent} are sealed with"
        )
    if check is None and cipher is not None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cipher.check_value())
            f.flush()
            os.fsync(f.fileno())
