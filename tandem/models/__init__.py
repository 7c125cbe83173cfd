from tandem.models.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LoadedModel", "load_model"]
