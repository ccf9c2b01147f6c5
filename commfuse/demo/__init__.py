"""The bundled example model."""
