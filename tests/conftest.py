from parity_helpers import PINS, installed_version


def pytest_report_header(config):
    """The peer versions the parity suite ran against (tests marked `parity`)."""
    parts = []
    for dist, pin in PINS.items():
        version = installed_version(dist)
        if version is None:
            parts.append(f"{dist}: not installed (pin {pin}, its parity tests skip)")
        elif version != pin:
            parts.append(f"{dist}=={version} (pin {pin}: its parity tests skip)")
        else:
            parts.append(f"{dist}=={version}")
    return "parity peers: " + ", ".join(parts)
