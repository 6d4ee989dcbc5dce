-- pgcascade schema, migration 12: no stored secrets; copy errors per table (docs/operations.md,
-- "Security").
--
-- Node locations travel to every node and through the queue: from this release they never
-- carry a password (pgcascade strips `password` and `sslpassword` before it stores or sends a
-- location; the node that connects finds the password in its ~/.pgpass, a service file or its
-- environment).  This upgrade takes them out of what earlier releases stored: node_location,
-- and the location events still queued here (rewriting their text in place changes no batch:
-- a batch is cut by ev_txid, and the events are only ever read as locations).
--
-- subscriber_table.last_error   the copy process's last failure on the table (a missing
--                               privilege, say), cleared when it works again; `status` shows it
--
-- The conninfo rules are libpq's: key = value pairs whose value is single-quoted (with \' and \\)
-- or runs to the next blank, or a URI postgres[ql]://user:password@host/db?password=...

create function pg_temp.pgcascade_without_secrets(i_dsn text) returns text
language sql immutable as $$
    select case
        when i_dsn ~ '^postgres(ql)?://' then
            regexp_replace(
                regexp_replace(
                    regexp_replace(i_dsn, '^(postgres(ql)?://[^:@/?#]*):[^@/?#]*@', '\1@'),
                    '([?&])(ssl)?password=[^&#]*&?', '\1', 'g'),
                '[?&]$', '')
        else
            btrim(regexp_replace(
                i_dsn, '(^|\s)(ssl)?password\s*=\s*(''([^''\\]|\\.)*''|([^\s\\]|\\.)+)', '\1', 'g'))
    end
$$;

update pgcascade.node_location
   set node_location = pg_temp.pgcascade_without_secrets(node_location)
 where node_location <> pg_temp.pgcascade_without_secrets(node_location);

update pgcascade.event
   set ev_extra1 = pg_temp.pgcascade_without_secrets(ev_extra1)
 where ev_type = 'pgcascade.location' and ev_extra1 <> pg_temp.pgcascade_without_secrets(ev_extra1);

drop function pg_temp.pgcascade_without_secrets(text);

alter table pgcascade.subscriber_table add column last_error text;
alter table pgcascade.subscriber_table add column last_error_time timestamptz;
