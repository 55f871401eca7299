"""deviceplugin."""
