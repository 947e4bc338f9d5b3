"""A run's conversations, from its configuration: built over a loaded model, kept on disk, brought back.

    building.py   session_for, driver_for: the ChatSession a RunConfig asks for over a loaded model; its driver
    keeping.py    data_dir, state_key, state_to_restore, save_state: where conversations live, their cache states

The floor above interface/ (it reads RunConfig) and below the app and the server, which both hold conversations.
"""
