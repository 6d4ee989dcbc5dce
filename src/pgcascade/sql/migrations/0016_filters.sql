-- pgcascade schema, migration 16: row filters and column lists of a subscriber's tables.
--
-- subscriber_table.row_filter   add-table --where: the server's own deparse of the DBA's
--                               predicate (replica/filters.py), one expression, names outside
--                               pg_catalog qualified; the rows the node holds are those of the
--                               provider's table for which it is true.  NULL: every row.
-- subscriber_table.column_list  add-table --columns: the columns applied, copied and compared
--                               (the key among them).  NULL: every column both sides have.
alter table pgcascade.subscriber_table add column row_filter text, add column column_list text[];

-- apply_rows takes the filter: the old signature goes (92_apply.sql makes the new one)
drop function if exists pgcascade.apply_rows(text, regclass, text[], text[], int8, int8, pg_snapshot);
