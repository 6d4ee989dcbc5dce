-- pgcascade.version(): the version of the installed functions.
create or replace function pgcascade.version() returns text
language sql immutable as $$ select '0.1.0'::text $$;
