import pytest

from autotune.errors import UsageError
from autotune.units import format_bytes, parse_memory


@pytest.mark.parametrize(
    "text, expected",
    [
        ("20GB", 20 * 10**9),
        ("20GiB", 20 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("1.5GiB", int(1.5 * 2**30)),
        (" 70 GiB ", 70 * 2**30),
        ("20GIB", 20 * 2**30),
    ],
)
def test_parse_memory_units(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["20", "20XB", "-5GB", "0GB", "", "GB", "20 G B", "20Gb", "20gib", "1e3GB"])
def test_parse_memory_refuses_bad_sizes_naming_them(text):
    with pytest.raises(UsageError) as err:
        parse_memory(text)
    assert repr(text) in str(err.value)
    assert "\n" not in str(err.value)


def test_decimal_and_binary_units_differ():
    assert parse_memory("20GiB") / parse_memory("20GB") == pytest.approx(1.0737, rel=1e-4)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**30) == "1 GiB"
    assert format_bytes(1.5 * 2**20) == "1.5 MiB"
    assert format_bytes(-(2**20)) == "-1 MiB"
