"""cascade"""
