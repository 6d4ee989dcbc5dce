"""The bulk data pipeline on Apache Spark: compare, repair (and, later, copy and the lake sink).

Modules, one per role:

    session      the SparkSession built from the job's config (local, cluster or Spark Connect)
    consistency  the sync point: provider locked, subscriber caught up, snapshots exported
    segments     key ranges and the SQL that hashes, lists and fetches the rows of one range
    compare      Spark jobs: range checksums, bisection, per-row diff (DataFrame -> DataFrame)
    repair       the diff as SQL statements, written out or applied in one transaction

Row data stays in PostgreSQL and in Spark tasks: the driver sees key ranges, counts and
checksums, and only the rows that differ, which it streams to the report or the SQL writer.
"""
