"""Static checks of the deployment artefacts under ``deploy/``."""
