"""The error tree (one root, facts that survive pickling) and settings read from KVRAY_* variables."""

from __future__ import annotations

import copy
import pickle

import pytest

import kvray
import kvray.errors as errors
from kvray.config import GPU_PAGE_SIZE, PAGE_SIZE, Settings
from kvray.errors import (
    BlockIdError,
    BoundsError,
    ConfigError,
    GeometryMismatchError,
    KvrayError,
    LayoutError,
    MetadataError,
    PlanError,
    RegionError,
    TransferTimeoutError,
    TransportError,
    UnknownLayerError,
    WireDecodeError,
)

ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__]


def test_all_lists_every_error_class() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)


def test_kvray_exports_every_branch_of_the_tree() -> None:
    """Any kvray error can be caught by a name `kvray` exports: the root and its children."""
    branches = {"KvrayError"} | {cls.__name__ for cls in ERROR_CLASSES if KvrayError in cls.__bases__}
    exported = {name for name in kvray.__all__ if name.endswith("Error")}
    assert branches <= exported <= set(errors.__all__)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_is_a_kvray_error(cls: type[KvrayError]) -> None:
    assert issubclass(cls, KvrayError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_pickles_with_its_facts(cls: type[KvrayError]) -> None:
    error = cls("layer 'dense1' would be written at 4096", engine_id="decode-0", layer="dense1", offset=4096)
    for restored in (pickle.loads(pickle.dumps(error)), copy.deepcopy(error), copy.copy(error)):
        assert type(restored) is cls
        assert str(restored) == error.message == "layer 'dense1' would be written at 4096"
        assert restored.message == error.message
        assert restored.facts == {"engine_id": "decode-0", "layer": "dense1", "offset": 4096}
        assert restored.layer == "dense1"
        assert restored.offset == 4096
        assert restored.args == error.args


def test_facts_are_attributes_and_missing_ones_are_attribute_errors() -> None:
    error = BoundsError("out", side="remote", op=3, offset=-1)
    assert (error.side, error.op, error.offset) == ("remote", 3, -1)
    with pytest.raises(AttributeError):
        _ = error.layer
    assert not hasattr(error, "engine_id")
    assert getattr(error, "engine_id", None) is None


def test_facts_are_a_copy() -> None:
    facts = {"layer": "dense0"}
    error = UnknownLayerError("missing", **facts)
    facts["layer"] = "dense1"
    assert error.layer == "dense0"


def test_a_pickled_error_keeps_no_reference_to_its_cause() -> None:
    try:
        try:
            raise OSError("registration failed: errno 22")
        except OSError as cause:
            raise RegionError("cannot register", errno=22) from cause
    except RegionError as error:
        restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is RegionError
    assert restored.errno == 22


def test_error_tree_shape() -> None:
    assert issubclass(TransferTimeoutError, TimeoutError)
    assert issubclass(TransferTimeoutError, TransportError)
    for cls in (LayoutError, PlanError, WireDecodeError, ConfigError, BlockIdError, GeometryMismatchError):
        assert issubclass(cls, ValueError), cls
    assert issubclass(BoundsError, RegionError)
    assert issubclass(WireDecodeError, MetadataError)
    assert issubclass(UnknownLayerError, MetadataError)
    assert not issubclass(RegionError, ValueError)
    assert not issubclass(MetadataError, PlanError)


def test_timeout_is_caught_as_timeout() -> None:
    with pytest.raises(TimeoutError):
        raise TransferTimeoutError("decode-0 did not answer in 30 s", engine_id="decode-0")


# ---- settings from the environment ----------------------------------------------------------


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.alignment == PAGE_SIZE == 4096
    assert settings.gpu_alignment == GPU_PAGE_SIZE
    assert settings.shm_dir == "/dev/shm"


def test_alignment_is_read_from_the_environment() -> None:
    assert Settings.from_env({"KVRAY_ALIGNMENT": "8192"}).alignment == 8192


def test_os_environ_is_the_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRAY_ALIGNMENT", "16384")
    monkeypatch.setenv("KVRAY_TRANSFER_TIMEOUT_S", "2.5")
    monkeypatch.setenv("KVRAY_SHM_DIR", "/tmp")
    settings = Settings.from_env()
    assert (settings.alignment, settings.transfer_timeout_s, settings.shm_dir) == (16384, 2.5, "/tmp")


def test_overrides_win_over_the_environment() -> None:
    settings = Settings.from_env(
        {"KVRAY_ALIGNMENT": "8192", "KVRAY_MAX_CONCURRENT_TRANSFERS": "3"}, alignment=65536
    )
    assert settings.alignment == 65536
    assert settings.max_concurrent_transfers == 3


def test_other_variables_are_ignored() -> None:
    assert Settings.from_env({"ALIGNMENT": "3", "KVRAY": "x", "kvray_alignment": "3"}) == Settings()


@pytest.mark.parametrize(
    ("variable", "value", "setting"),
    [
        ("KVRAY_ALIGNMENT", "a page", "alignment"),
        ("KVRAY_ALIGNMENT", "4096.5", "alignment"),
        ("KVRAY_GPU_ALIGNMENT", "2MiB", "gpu_alignment"),
        ("KVRAY_LOOKUP_TIMEOUT_S", "soon", "lookup_timeout_s"),
        ("KVRAY_MAX_QUEUED_TRANSFERS", "many", "max_queued_transfers"),
    ],
)
def test_unparsable_values_raise_config_error_naming_the_variable(
    variable: str, value: str, setting: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({variable: value})
    assert variable in str(caught.value)
    assert caught.value.setting == setting
    assert caught.value.value == value


@pytest.mark.parametrize("value", ["1000", "0", "-4096", "4097"])
def test_alignment_must_be_a_power_of_two(value: str) -> None:
    with pytest.raises(ConfigError, match="alignment"):
        Settings.from_env({"KVRAY_ALIGNMENT": value})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVRAY_LOOKUP_TIMEOUT_S", "0"),
        ("KVRAY_TRANSFER_TIMEOUT_S", "-1"),
        ("KVRAY_MAX_CONCURRENT_TRANSFERS", "0"),
        ("KVRAY_MAX_QUEUED_TRANSFERS", "-5"),
        ("KVRAY_COPY_THREADS", "-1"),
    ],
)
def test_non_positive_limits_raise_config_error(variable: str, value: str) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({variable: value})


def test_copy_threads_come_from_the_environment() -> None:
    assert Settings().copy_threads == 0  # pick
    assert Settings.from_env({"KVRAY_COPY_THREADS": "1"}).copy_threads == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("alignment", 1000),
        ("gpu_alignment", 3),
        ("lookup_timeout_s", 0.0),
        ("max_queued_transfers", 0),
        ("copy_threads", -2),
        ("notice_port", 70000),
        ("notice_port", -1),
        ("notice_host", "decode-node-1"),
        ("notice_host", "0.0.0.0:9000"),
        ("notice_ports", 0),
    ],
)
def test_direct_construction_is_validated_with_facts(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(**{field: value})  # type: ignore[arg-type]
    assert caught.value.setting == field


def test_the_notice_listener_settings_come_from_the_environment() -> None:
    settings = Settings.from_env(
        {"KVRAY_NOTICE_TCP": "0", "KVRAY_NOTICE_HOST": "10.0.0.7", "KVRAY_NOTICE_PORT": "7070"}
    )
    assert (settings.notice_tcp, settings.notice_host, settings.notice_port) == (False, "10.0.0.7", 7070)
    assert Settings().notice_tcp and Settings().notice_host == "" and Settings().notice_port == 0
    assert Settings.from_env({"KVRAY_NOTICE_PORT": "20000", "KVRAY_NOTICE_PORTS": "64"}).notice_ports == 64
    with pytest.raises(ConfigError, match="notice_ports"):
        Settings(notice_port=65500, notice_ports=64)


def test_a_non_power_of_two_alignment_from_the_environment_keeps_its_facts() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({"KVRAY_ALIGNMENT": "1000"})
    assert caught.value.facts.get("setting") == "alignment"
    assert "KVRAY_ALIGNMENT" in str(caught.value)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_timeouts_must_be_finite(value: str) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"KVRAY_TRANSFER_TIMEOUT_S": value})
