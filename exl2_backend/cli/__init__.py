"""Command-line interface: `exl2-backend generate | info | bench | serve | convert`."""
