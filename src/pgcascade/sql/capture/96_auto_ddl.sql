-- Automatic DDL on a root or a two-way master (docs/ddl.md): event triggers capture the DDL
-- that touches the set's tables into the queue, inside the DDL's own transaction, so the EXECUTE
-- event takes its place among the row changes of that transaction and subscribers (and peers)
-- run it at exactly that point of the stream.  DDL that cannot be replicated safely is refused
-- there, by raising: the statement, and its transaction, do not happen.
--
-- The event: ev_type EXECUTE (as `pgcascade CONF execute` writes it, so any worker runs it),
-- ev_data the statement, ev_extra1 its description as JSON:
--   {"auto-ddl": 1, "command": TAG, "search_path": [schemas], "tables": [set tables it changes],
--    "created": {table: [key columns]}, "dropped": [tables]}
-- (`execute` writes the script's file name there instead: every worker runs such scripts.)
--
-- What is never captured: pgcascade's own sessions (they set pgcascade.auto_ddl = off, as any
-- session may to keep a statement on this node), a peer's apply (it runs as a replica session,
-- where event triggers do not fire), and commands of extension scripts.
--
-- Event triggers need a superuser to create them (auto_ddl_install, called by `auto-ddl on`);
-- their functions run as pgcascade's role (security definer), whoever runs the DDL.

-- pgcascade.ddl_statements(query) -> the statements of a query string, each as its tokens:
-- unquoted words lowercased, "quoted identifiers" with a leading '"', every string literal as
-- '''', every number as '0', any other character as itself; comments and blanks dropped.
create or replace function pgcascade.ddl_statements(i_query text) returns setof text[]
language plpgsql immutable as $$
declare
    c text[] := regexp_split_to_array(coalesce(i_query, ''), '');
    n int := coalesce(array_length(c, 1), 0);
    i int := 1;
    j int;
    depth int;
    tag text;
    ch text;
    word text;
    toks text[] := '{}';
begin
    while i <= n loop
        ch := c[i];
        if ch ~ '^\s$' or ch = '' then
            i := i + 1;
        elsif ch = '-' and i < n and c[i + 1] = '-' then
            while i <= n and c[i] <> E'\n' loop i := i + 1; end loop;
        elsif ch = '/' and i < n and c[i + 1] = '*' then
            depth := 1;
            i := i + 2;
            while i <= n and depth > 0 loop
                if c[i] = '/' and i < n and c[i + 1] = '*' then
                    depth := depth + 1; i := i + 2;
                elsif c[i] = '*' and i < n and c[i + 1] = '/' then
                    depth := depth - 1; i := i + 2;
                else
                    i := i + 1;
                end if;
            end loop;
        elsif ch = '''' then
            -- E'...' strings take backslash escapes; every string doubles its quotes
            i := i + 1;
            while i <= n loop
                if c[i] = '\' and toks[array_length(toks, 1)] = 'e' then
                    i := i + 2;
                elsif c[i] = '''' and i < n and c[i + 1] = '''' then
                    i := i + 2;
                elsif c[i] = '''' then
                    exit;
                else
                    i := i + 1;
                end if;
            end loop;
            i := i + 1;
            if toks[array_length(toks, 1)] in ('e', 'b', 'x', 'n', 'u') then
                toks[array_length(toks, 1)] := '''';
            else
                toks := toks || ''''::text;
            end if;
        elsif ch = '"' then
            word := '';
            i := i + 1;
            while i <= n loop
                if c[i] = '"' and i < n and c[i + 1] = '"' then
                    word := word || '"'; i := i + 2;
                elsif c[i] = '"' then
                    exit;
                else
                    word := word || c[i]; i := i + 1;
                end if;
            end loop;
            i := i + 1;
            toks := toks || ('"' || word);
        elsif ch = '$' and i < n and c[i + 1] ~ '^[A-Za-z_$]$' then
            -- a dollar quote (two dollars, or a tag between them), to the same quote again
            j := i + 1;
            while j <= n and c[j] <> '$' and c[j] ~ '^[A-Za-z0-9_]$' loop j := j + 1; end loop;
            if j <= n and c[j] = '$' then
                tag := array_to_string(c[i:j], '');
                depth := strpos(substr(i_query, j + 1), tag);
                i := case when depth = 0 then n + 1 else j + depth + length(tag) end;
                toks := toks || ''''::text;
            else
                toks := toks || ch;
                i := i + 1;
            end if;
        elsif ch ~ '^[A-Za-z_]$' or ascii(ch) > 127 then
            j := i;
            while j <= n and (c[j] ~ '^[A-Za-z0-9_$]$' or ascii(c[j]) > 127) loop j := j + 1; end loop;
            toks := toks || lower(array_to_string(c[i:j - 1], ''));
            i := j;
        elsif ch ~ '^[0-9]$' or (ch = '.' and i < n and c[i + 1] ~ '^[0-9]$') then
            j := i;
            while j <= n and c[j] ~ '^[0-9.eE]$' loop j := j + 1; end loop;
            toks := toks || '0'::text;
            i := j;
        elsif ch = ';' then
            if array_length(toks, 1) > 0 then
                return next toks;
            end if;
            toks := '{}';
            i := i + 1;
        else
            toks := toks || ch;
            i := i + 1;
        end if;
    end loop;
    if array_length(toks, 1) > 0 then
        return next toks;
    end if;
end $$;

-- pgcascade.ddl_local_actions(tokens) -> of an ALTER TABLE statement, how many of its actions
-- keep to this node (owner, triggers, rules, row level security, tablespace, partitions), and
-- how many actions it has.  Such actions name roles, triggers, tablespaces of this node, or its
-- own partitions (a subscriber may partition a table another way): they are not replicated.
create or replace function pgcascade.ddl_local_actions(i_toks text[], out local_actions int, out actions int)
language plpgsql immutable as $$
declare
    n int := coalesce(array_length(i_toks, 1), 0);
    i int := 3;
    depth int := 0;
    first text[] := '{}';
    a text[];
begin
    local_actions := 0;
    actions := 0;
    if n < 3 or i_toks[1] <> 'alter' or i_toks[2] <> 'table' then
        return;
    end if;
    if i_toks[i] = 'if' then i := i + 2; end if;                -- if exists
    if i_toks[i] = 'only' then i := i + 1; end if;
    if i_toks[i] = 'all' then                                  -- all in tablespace
        local_actions := 1; actions := 1;
        return;
    end if;
    i := i + 1;                                                 -- the name
    if i_toks[i] = '.' then i := i + 2; end if;
    if i_toks[i] = '*' then i := i + 1; end if;
    -- the actions, comma-separated at depth 0; the first three words of each decide
    while i <= n + 1 loop
        if i > n or (i_toks[i] = ',' and depth = 0) then
            if array_length(first, 1) > 0 then
                actions := actions + 1;
                a := first || array['', '', ''];
                if (a[1] = 'owner' and a[2] = 'to')
                   or (a[1] in ('enable', 'disable') and (a[2] in ('trigger', 'rule', 'row')
                                                          or (a[2] in ('always', 'replica') and a[3] in ('trigger', 'rule'))))
                   or (a[1] = 'force' and a[2] = 'row') or (a[1] = 'no' and a[2] = 'force')
                   or (a[1] = 'set' and a[2] = 'tablespace')
                   or (a[1] in ('attach', 'detach') and a[2] = 'partition') then
                    local_actions := local_actions + 1;
                end if;
            end if;
            first := '{}';
        elsif i_toks[i] = '(' then
            depth := depth + 1;
        elsif i_toks[i] = ')' then
            depth := depth - 1;
        elsif depth = 0 and coalesce(array_length(first, 1), 0) < 3 then
            first := first || i_toks[i];
        end if;
        i := i + 1;
    end loop;
end $$;

-- pgcascade.ddl_refuse(why, how): raise the refusal of a DDL statement; nothing of its transaction
-- happens.
create or replace function pgcascade.ddl_refuse(i_why text, i_how text) returns void
language plpgsql as $$
begin
    raise exception 'pgcascade auto-ddl: %', i_why using errcode = '0A000', hint = i_how;
end $$;

-- pgcascade.auto_ddl_tables() -> the set tables of every queue this database is the root of with
-- auto-ddl on: (queue, table, its oid here, key columns, event format, whether the queue has peers).
create or replace function pgcascade.auto_ddl_tables(
    out queue_name text, out table_name text, out rel oid, out key_columns text[], out event_format text,
    out add_new_tables bool, out two_way bool)
returns setof record
language sql stable as $$
    select a.queue_name, st.table_name, to_regclass(st.table_name)::oid, st.key_columns, st.event_format,
           a.add_new_tables,
           exists (select 1 from pgcascade.node p where p.peer_of = a.queue_name)
      from pgcascade.auto_ddl a
      join pgcascade.node n on n.queue_name = a.queue_name and n.node_type = 'root' and n.peer_of is null
      join pgcascade.set_table st on st.queue_name = a.queue_name
$$;

-- pgcascade.ddl_key_problem(table, keys) -> why the table's key is no longer one (a key column
-- gone or nullable, no unique index on exactly the key columns), or null.
create or replace function pgcascade.ddl_key_problem(i_table regclass, i_keys text[]) returns text
language sql stable as $$
    select coalesce(
        (select format('key column %I is gone or allows NULL', k) from unnest(i_keys) k
          where not exists (select 1 from pg_attribute a where a.attrelid = i_table and a.attname = k
                               and a.attnum > 0 and not a.attisdropped and a.attnotnull)
          limit 1),
        case when not exists (
            select 1 from pg_index i
             where i.indrelid = i_table and i.indisunique and i.indpred is null and i.indexprs is null
               and (select array_agg(a.attname::text order by a.attname) from pg_attribute a
                     where a.attrelid = i_table and a.attnum = any(i.indkey))
                   = (select array_agg(k order by k) from unnest(i_keys) k))
        then format('no unique index is left on its key (%s)', array_to_string(i_keys, ', ')) end)
$$;

-- pgcascade.ddl_mutable_default(table, attnum) -> the text of the column's default when it is not
-- immutable (a function or operator that is not, a CURRENT_* value, a cast through text), or
-- null.  Read from the stored expression, without evaluating it.
create or replace function pgcascade.ddl_mutable_default(i_table regclass, i_attnum int2) returns text
language sql stable as $$
    select pg_get_expr(d.adbin, d.adrelid)
      from pg_attrdef d
     where d.adrelid = i_table and d.adnum = i_attnum
       and (d.adbin::text ~ '\{(SQLVALUEFUNCTION|COERCEVIAIO|NEXTVALUEEXPR)'
            or exists (select 1 from regexp_matches(d.adbin::text, ':(funcid|opfuncid|opno) (\d+)', 'g') m
                         join pg_proc p on p.oid = case when m[1] = 'opno'
                                                        then (select o.oprcode::oid from pg_operator o
                                                               where o.oid = m[2]::oid)
                                                        else m[2]::oid end
                        where p.provolatile <> 'i'))
$$;

-- pgcascade.ddl_check_table(table, name before, keys, two_way, before) -> void: refuse what the
-- command just did to a set table that replication cannot follow.  `before`: the table as
-- ddl_command_start saw it (columns by attnum), or null.
create or replace function pgcascade.ddl_check_table(
    i_rel oid, i_name text, i_keys text[], i_two_way bool, i_before jsonb)
returns void
language plpgsql as $$
declare
    v_now text;
    v_why text;
    r record;
    v_how_key text := 'remove-table it on the root and its subscribers, change it there with'
                      ' `pgcascade CONF execute FILE`, then add-table it again';
begin
    select format('%I.%I', n.nspname, c.relname) into v_now
      from pg_class c join pg_namespace n on n.oid = c.relnamespace where c.oid = i_rel;
    if v_now is distinct from i_name then
        perform pgcascade.ddl_refuse(format('%s is replicated under its name: renaming it or moving it to'
                                            ' another schema is not replicated', i_name), v_how_key);
    end if;
    if (select relpersistence from pg_class where oid = i_rel) <> 'p' then
        perform pgcascade.ddl_refuse(format('%s would be UNLOGGED: an unlogged table is not replicated'
                                            ' (a crash empties it, and logical decoding never sees it)', i_name),
                                     'keep replicated tables logged; remove-table it first to make it unlogged');
    end if;
    if exists (select 1 from pg_trigger where tgrelid = i_rel and tgname like '\_pgcascade\_%' and tgenabled = 'D') then
        perform pgcascade.ddl_refuse(format('this would disable pgcascade''s triggers on %s, and its changes'
                                            ' would no longer be captured', i_name),
                                     'name your own triggers in ENABLE/DISABLE TRIGGER (not ALL or USER)');
    end if;
    for r in select a.attnum, a.attname::text as attname, a.atttypid, a.atttypmod, a.attidentity,
                    a.attgenerated, i_before -> 'cols' -> a.attnum::text as was
               from pg_attribute a where a.attrelid = i_rel and a.attnum > 0 and not a.attisdropped
                and i_before is not null loop
        if r.was is null then  -- a new column: its value for the rows already there
            if r.attidentity <> '' then
                perform pgcascade.ddl_refuse(format('new identity column %I of %s: each node would number'
                                                    ' the rows already there in its own order', r.attname, i_name),
                    'add the column without a default, fill it with UPDATE (replicated as rows), then make it'
                    ' an identity column');
            end if;
            v_why := case when r.attgenerated = '' then pgcascade.ddl_mutable_default(i_rel::regclass, r.attnum) end;
            if v_why is not null then
                perform pgcascade.ddl_refuse(format('the default of new column %I of %s (%s) is not immutable:'
                                                    ' each node would give the rows already there its own value',
                                                    r.attname, i_name, v_why),
                    'add the column without the default, set it with ALTER COLUMN ... SET DEFAULT (it is for new'
                    ' rows only), and fill the rows there with UPDATE (replicated as rows)');
            end if;
        elsif r.was ->> 0 <> r.attname and (r.was ->> 0 = any(i_keys) or i_two_way) then
            perform pgcascade.ddl_refuse(format('column %I of %s would be renamed %I: %s', r.was ->> 0, i_name,
                                                r.attname, case when i_two_way
                then 'a peer''s changes made before it sees the rename would lose that column''s values'
                else 'it is a key column, and the set names its key' end),
                case when i_two_way then 'stop writes on every master, run it with `pgcascade CONF execute FILE`,'
                                         ' and wait until every master has applied it'
                     else v_how_key end);
        elsif i_two_way and r.was ->> 0 = any(i_keys)
              and ((r.was ->> 1)::oid, (r.was ->> 2)::int) is distinct from (r.atttypid, r.atttypmod) then
            perform pgcascade.ddl_refuse(format('key column %I of %s would change type on a two-way master:'
                                                ' changes from the other masters, and their conflicts, are'
                                                ' matched by the key', r.attname, i_name),
                'stop writes on every master, run it with `pgcascade CONF execute FILE`, and wait until every'
                ' master has applied it');
        end if;
    end loop;
    v_why := pgcascade.ddl_key_problem(i_rel, i_keys);
    if v_why is not null then
        perform pgcascade.ddl_refuse(format('%s is replicated by its key (%s): %s', i_name,
                                            array_to_string(i_keys, ', '), v_why), v_how_key);
    end if;
end $$;

-- pgcascade.ddl_refresh_capture(queue, table, keys, format) -> void: after DDL changed a set
-- table, its capture follows the new definition (the generated trigger functions name json
-- columns and, for the sql format, every column; logical capture may need REPLICA IDENTITY FULL
-- for a wide column).
create or replace function pgcascade.ddl_refresh_capture(i_queue text, i_table regclass, i_keys text[], i_format text)
returns void
language plpgsql as $$
begin
    if exists (select 1 from pgcascade.walcapture where queue_name = i_queue) then
        perform pgcascade.walcapture_add_table(i_queue, i_table, i_keys);
    elsif exists (select 1 from pg_trigger where tgrelid = i_table and tgname = '_pgcascade_capture_ins') then
        perform 1 from pgcascade.queue where queue_name = i_queue for update;
        perform pgcascade.capture_functions(i_queue, i_table, i_keys, i_format);
    end if;
end $$;

-- pgcascade.ddl_table_created(queue, table, keys) -> void: a table made by DDL joins the set (the
-- origin's event trigger, and the apply of a peer's DDL on a two-way master): captured, two-way
-- and subscribed from every peer in state ok when the queue has peers (it is empty everywhere
-- at this point of the stream), and the table list event.
create or replace function pgcascade.ddl_table_created(i_queue text, i_table regclass, i_keys text[])
returns void
language plpgsql as $$
declare
    v_name text := (select format('%I.%I', n.nspname, c.relname) from pg_class c
                      join pg_namespace n on n.oid = c.relnamespace where c.oid = i_table);
    p record;
begin
    if exists (select 1 from pgcascade.walcapture where queue_name = i_queue) then
        perform pgcascade.walcapture_add_table(i_queue, i_table, i_keys);
    else
        perform pgcascade.capture_enable(i_queue, i_table, i_keys, 'json');
    end if;
    insert into pgcascade.set_table (queue_name, table_name, key_columns) values (i_queue, v_name, i_keys)
        on conflict (queue_name, table_name) do update set key_columns = excluded.key_columns;
    for p in select queue_name from pgcascade.node where peer_of = i_queue loop
        insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state, local_writes)
        values (p.queue_name, v_name, v_name, i_keys, 'ok', true)
        on conflict (queue_name, table_name) do nothing;
    end loop;
    if found then
        perform pgcascade.two_way_table(i_table, i_keys, true);
    end if;
    perform pgcascade.emit_event(i_queue, 'T',
        (select string_agg(table_name, ',' order by table_name) from pgcascade.set_table where queue_name = i_queue),
        null);
end $$;

-- pgcascade.ddl_table_dropped(queue, table, oid) -> void: a set table was dropped (by the origin's
-- DROP TABLE, or a peer's replayed here): it leaves the set and every peer subscription, its
-- capture functions, row versions and TRUNCATE tombstone go, and the table list event.
create or replace function pgcascade.ddl_table_dropped(i_queue text, i_table text, i_oid oid)
returns void
language plpgsql as $$
declare
    op text;
begin
    delete from pgcascade.set_table where queue_name = i_queue and table_name = i_table;
    delete from pgcascade.subscriber_table s using pgcascade.node p
     where p.peer_of = i_queue and s.queue_name = p.queue_name and s.table_name = i_table;
    delete from pgcascade.row_version where table_name = i_table;
    delete from pgcascade.table_truncate where table_name = i_table;
    foreach op in array array['ins', 'upd', 'del', 'trunc'] loop
        execute format('drop function if exists pgcascade.%I()', 'capture_' || i_oid || '_' || op);
    end loop;
    perform pgcascade.emit_event(i_queue, 'T',
        (select string_agg(table_name, ',' order by table_name) from pgcascade.set_table where queue_name = i_queue),
        null);
end $$;

-- pgcascade.ddl_emit(queue, statement, meta) -> void: the EXECUTE event of a captured statement.
create or replace function pgcascade.ddl_emit(i_queue text, i_statement text, i_meta jsonb) returns void
language sql as $$
    select pgcascade.emit_event(i_queue, 'EXECUTE', i_statement, i_meta::text)
$$;

-- pgcascade.ddl_start(tag): ddl_command_start of ALTER TABLE and DROP INDEX.  What the command's
-- end needs to know of the set tables before it ran: their names, columns by number, indexes.
create or replace function pgcascade.ddl_start(i_tag text) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    if coalesce(current_setting('pgcascade.auto_ddl', true), '') = 'off'
       or not exists (select 1 from pgcascade.auto_ddl) then
        return;
    end if;
    perform set_config('pgcascade.ddl_before', coalesce((
        select jsonb_object_agg(t.rel::text, jsonb_build_object(
                   'table', t.table_name, 'natts', c.relnatts,
                   'cols', (select jsonb_object_agg(a.attnum::text, jsonb_build_array(a.attname, a.atttypid::int8, a.atttypmod))
                              from pg_attribute a where a.attrelid = t.rel and a.attnum > 0 and not a.attisdropped),
                   'indexes', (select coalesce(jsonb_agg(i.indexrelid::int8), '[]') from pg_index i where i.indrelid = t.rel)))
          from (select distinct rel, table_name from pgcascade.auto_ddl_tables() where rel is not null) t
          join pg_class c on c.oid = t.rel), '{}')::text, true);
end $$;

-- pgcascade.ddl_one_statement(tag) -> the statement of the client's query, when it is one
-- statement of the command `tag`; refused otherwise (a query string of several statements, a
-- function, a DO block: their text is not the statement).
create or replace function pgcascade.ddl_one_statement(i_tag text, i_what text) returns text[]
language plpgsql as $$
declare
    v_toks text[];
    v_first text[];
    v_count int := 0;
    v_words text[] := string_to_array(lower(i_tag), ' ');
begin
    for v_toks in select s from pgcascade.ddl_statements(current_query()) s loop
        v_count := v_count + 1;
        v_first := coalesce(v_first, v_toks);
    end loop;
    -- the command's words lead the statement (CREATE [UNIQUE] INDEX, CREATE [UNLOGGED] TABLE ...)
    if v_count = 1 and v_first[1] = v_words[1] and (v_words[2] is null or v_words[2] = any(v_first[2:5])) then
        return v_first;
    end if;
    perform pgcascade.ddl_refuse(
        format('this %s changes %s, and it is not the only statement of the query (a query string of several'
               ' statements, a function, a DO block): its text cannot be replayed alone', i_tag, i_what),
        'send it as a statement of its own, or run the script with `pgcascade CONF execute FILE`');
    return null;
end $$;

-- pgcascade.ddl_quiet(values) -> the values before: pgcascade's own DDL inside the event
-- triggers (the capture triggers of a new table, a dropped table's functions) is neither
-- captured nor chatty ('off', 'warning'); ddl_quiet(the values before) puts them back.
create or replace function pgcascade.ddl_quiet(i_values text[] default array['off', 'warning']) returns text[]
language plpgsql as $$
declare
    v_prev text[] := array[current_setting('pgcascade.auto_ddl', true), current_setting('client_min_messages')];
begin
    perform set_config('pgcascade.auto_ddl', coalesce(i_values[1], ''), true);
    perform set_config('client_min_messages', i_values[2], true);
    return v_prev;
end $$;

-- pgcascade.ddl_end(tag, search_path): ddl_command_end.  The set tables the command changed
-- (their indexes and comments included) are checked and the statement queued;
-- with --add-new-tables, a table created in a schema of the set's tables joins the set.
create or replace function pgcascade.ddl_end(i_tag text, i_path name[]) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    cmd record;
    t record;
    q record;
    v_before jsonb;
    v_rel oid;
    v_toks text[];
    v_local record;
    v_stmt text;
    v_keys text[];
    v_name text;
    v_prev text[];
    v_done oid[] := '{}';
begin
    if coalesce(current_setting('pgcascade.auto_ddl', true), '') = 'off'
       or not exists (select 1 from pgcascade.auto_ddl) then
        return;
    end if;
    if i_tag in ('ALTER TABLE', 'DROP INDEX') then
        v_before := nullif(current_setting('pgcascade.ddl_before', true), '')::jsonb;
    end if;
    for cmd in select * from pg_event_trigger_ddl_commands() where command_tag = i_tag and not in_extension loop
        if cmd.schema_name = 'pgcascade' and (i_tag like 'CREATE %' or i_tag like 'ALTER %') then
            perform pgcascade.ddl_refuse(format('%s %s: pgcascade''s own objects change only through pgcascade',
                                                i_tag, cmd.object_identity),
                                         'use `pgcascade CONF install` (upgrades) and its verbs');
        end if;
        continue when not i_tag = any(pgcascade.ddl_trigger_tags('tables'));
        v_rel := case
            when cmd.classid = 'pg_class'::regclass and cmd.object_type = 'index'
                then (select indrelid from pg_index where indexrelid = cmd.objid)
            when cmd.classid = 'pg_class'::regclass and cmd.object_type in ('table', 'table column')
                then cmd.objid
            when cmd.classid = 'pg_constraint'::regclass
                then (select conrelid from pg_constraint where oid = cmd.objid) end;
        continue when v_rel is null;
        -- the set tables it changes (a renamed one by its name before)
        for t in select * from pgcascade.auto_ddl_tables() a
                  where a.rel = v_rel or a.table_name = (v_before -> v_rel::text ->> 'table') loop
            v_done := v_done || v_rel;
            v_stmt := current_query();
            if i_tag = 'CREATE INDEX' then
                v_stmt := pg_get_indexdef(cmd.objid);  -- named, qualified, never CONCURRENTLY
            else
                v_toks := pgcascade.ddl_one_statement(i_tag, t.table_name);
            end if;
            if i_tag = 'ALTER TABLE' then
                perform pgcascade.ddl_check_table(v_rel, t.table_name, t.key_columns, t.two_way,
                                                  v_before -> v_rel::text);
                v_local := pgcascade.ddl_local_actions(v_toks);
                continue when v_local.local_actions > 0 and v_local.local_actions = v_local.actions;
                if v_local.local_actions > 0 then
                    perform pgcascade.ddl_refuse(
                        format('this ALTER TABLE of %s mixes changes that are replicated with some that are'
                               ' not (OWNER TO, ENABLE/DISABLE TRIGGER or RULE, ROW LEVEL SECURITY, SET'
                               ' TABLESPACE: they name things of this node)', t.table_name),
                        'split it into two ALTER TABLE statements');
                end if;
            end if;
            perform pgcascade.ddl_emit(t.queue_name, v_stmt, jsonb_build_object(
                'auto-ddl', 1, 'command', i_tag, 'search_path', i_path, 'tables', jsonb_build_array(t.table_name)));
            if i_tag = 'ALTER TABLE' then
                v_prev := pgcascade.ddl_quiet();
                perform pgcascade.ddl_refresh_capture(t.queue_name, v_rel::regclass, t.key_columns, t.event_format);
                perform pgcascade.ddl_quiet(v_prev);
            end if;
        end loop;
        -- a new table in a schema of the set's tables, with --add-new-tables (not a partition:
        -- partitions are each node's own, the root's capture takes them from its maintenance)
        continue when i_tag not in ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO') or v_rel = any(v_done)
                      or cmd.objid <> v_rel;
        for q in select distinct a.queue_name from pgcascade.auto_ddl_tables() a
                   join pg_class s on s.oid = a.rel
                   join pg_class c on c.oid = cmd.objid and c.relnamespace = s.relnamespace
                  where a.add_new_tables and c.relpersistence = 'p' and c.relkind in ('r', 'p')
                    and not c.relispartition loop
            v_name := cmd.object_identity;
            if i_tag <> 'CREATE TABLE' then
                perform pgcascade.ddl_refuse(
                    format('%s makes %s from a query in a schema whose new tables are replicated: the'
                           ' statement cannot be replayed (each node would run the query on its own rows), and'
                           ' the table has no primary key', i_tag, v_name),
                    'create the table with CREATE TABLE and a primary key, then fill it with INSERT ... SELECT'
                    ' (its rows replicate as row changes)');
            end if;
            v_toks := pgcascade.ddl_one_statement(i_tag, v_name);
            select array_agg(a.attname::text order by k.ord) into v_keys
              from pg_index i cross join lateral unnest(i.indkey) with ordinality k(attnum, ord)
              join pg_attribute a on a.attrelid = i.indrelid and a.attnum = k.attnum
             where i.indrelid = cmd.objid and i.indisprimary;
            if v_keys is null then
                perform pgcascade.ddl_refuse(
                    format('new table %s has no primary key, and new tables of its schema are replicated', v_name),
                    'give it a PRIMARY KEY in its CREATE TABLE, or SET pgcascade.auto_ddl = off to keep it on this'
                    ' node only');
            end if;
            perform pgcascade.ddl_emit(q.queue_name, current_query(), jsonb_build_object(
                'auto-ddl', 1, 'command', i_tag, 'search_path', i_path, 'tables', '[]'::jsonb,
                'created', jsonb_build_object(v_name, v_keys)));
            v_prev := pgcascade.ddl_quiet();
            perform pgcascade.ddl_table_created(q.queue_name, cmd.objid::regclass, v_keys);
            perform pgcascade.ddl_quiet(v_prev);
        end loop;
    end loop;
end $$;

-- pgcascade.ddl_drop(tag): sql_drop.  DROP TABLE of set tables is queued (as DROP TABLE of exactly
-- those, CASCADE if the statement said so) and they leave the set; DROP INDEX of their indexes is
-- queued; any other command that drops a set table, one of its columns or pgcascade's own
-- objects is refused.
create or replace function pgcascade.ddl_drop(i_tag text) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    d record;
    t record;
    v_before jsonb;
    v_table text;
    v_why text;
    v_cascade text;
    v_dropped jsonb := '{}';
    v_prev text[];
    q text;
begin
    if coalesce(current_setting('pgcascade.auto_ddl', true), '') = 'off'
       or not exists (select 1 from pgcascade.auto_ddl) then
        return;
    end if;
    v_before := nullif(current_setting('pgcascade.ddl_before', true), '')::jsonb;
    v_cascade := case when exists (select 1 from pgcascade.ddl_statements(current_query()) s
                                    where 'cascade' = any(s)) then ' cascade' else '' end;
    for d in select * from pg_event_trigger_dropped_objects() where not is_temporary loop
        if d.schema_name = 'pgcascade' then
            perform pgcascade.ddl_refuse(format('%s drops %s %s: pgcascade''s own objects change only through'
                                                ' pgcascade', i_tag, d.object_type, d.object_identity),
                                         'use `pgcascade CONF install` (upgrades) and its verbs');
        end if;
        v_table := case
            when d.object_type = 'table' then d.object_identity
            when d.object_type in ('table column', 'trigger') then format('%I.%I', d.address_names[1], d.address_names[2])
            end;
        for t in select * from pgcascade.auto_ddl_tables() a where a.table_name = v_table loop
            if d.object_type = 'table' and i_tag <> 'DROP TABLE' then
                perform pgcascade.ddl_refuse(format('this %s drops replicated table %s along with it', i_tag, v_table),
                    'drop the table with DROP TABLE first (replicated), or remove-table it');
            elsif d.object_type = 'table' then
                v_dropped := jsonb_set(v_dropped, array[t.queue_name],
                                       coalesce(v_dropped -> t.queue_name, '{}') || jsonb_build_object(v_table, d.objid));
            elsif d.object_type = 'table column' and i_tag not in ('ALTER TABLE', 'DROP TABLE') then
                perform pgcascade.ddl_refuse(format('this %s drops column %s of replicated table %s along with it',
                                                    i_tag, d.address_names[3], v_table),
                    'drop the column with ALTER TABLE first (replicated)');
            elsif d.object_type = 'trigger' and d.address_names[3] like '\_pgcascade\_%' and i_tag <> 'DROP TABLE' then
                perform pgcascade.ddl_refuse(format('this %s drops pgcascade''s trigger %s on %s, and its changes'
                                                    ' would no longer be captured', i_tag, d.address_names[3], v_table),
                                             'they are managed by add-table and remove-table');
            end if;
        end loop;
        -- an index of a set table (known from before the command: its table is not in the list)
        if d.object_type = 'index' and i_tag = 'DROP INDEX' and v_before is not null then
            for t in select a.*, b.key from pgcascade.auto_ddl_tables() a, jsonb_each(v_before) b
                      where b.value -> 'indexes' @> to_jsonb(d.objid::int8) and a.table_name = b.value ->> 'table' loop
                v_why := pgcascade.ddl_key_problem(t.rel::regclass, t.key_columns);
                if v_why is not null then
                    perform pgcascade.ddl_refuse(format('%s is replicated by its key (%s): %s', t.table_name,
                                                        array_to_string(t.key_columns, ', '), v_why),
                                                 'create another unique index on the key first');
                end if;
                perform pgcascade.ddl_emit(t.queue_name, format('drop index %s', d.object_identity), jsonb_build_object(
                    'auto-ddl', 1, 'command', i_tag, 'search_path', '[]'::jsonb, 'tables', jsonb_build_array(t.table_name)));
            end loop;
        end if;
    end loop;
    -- the dropped set tables of each queue: the statement, then their leaving the set
    for q in select jsonb_object_keys(v_dropped) loop
        perform pgcascade.ddl_emit(q, format('drop table %s%s',
                (select string_agg(x, ', ') from jsonb_object_keys(v_dropped -> q) x), v_cascade),
            jsonb_build_object('auto-ddl', 1, 'command', i_tag, 'search_path', '[]'::jsonb, 'tables', '[]'::jsonb,
                               'dropped', (select jsonb_agg(x) from jsonb_object_keys(v_dropped -> q) x),
                               'cascade', v_cascade <> ''));
        v_prev := pgcascade.ddl_quiet();
        perform pgcascade.ddl_table_dropped(q, x.key, (x.value #>> '{}')::oid) from jsonb_each(v_dropped -> q) x;
        perform pgcascade.ddl_quiet(v_prev);
    end loop;
end $$;

-- The event trigger functions.  They run as pgcascade's role whoever runs the DDL, but without a
-- fixed search_path: the caller's is read here (the statement is replayed under it), and
-- nothing else is done before the functions above, which fix theirs.
create or replace function pgcascade.ddl_trigger_start() returns event_trigger
language plpgsql security definer as $$
begin
    perform pgcascade.ddl_start(tg_tag);
    if tg_tag = 'ALTER TABLE' then  -- 97_auto_ddl_key_type.sql
        perform pgcascade.ddl_lift_key_trigger(pg_catalog.current_schemas(false));
    end if;
end $$;

create or replace function pgcascade.ddl_trigger_end() returns event_trigger
language plpgsql security definer as $$
begin
    if tg_tag = 'ALTER TABLE' then
        perform pgcascade.ddl_restore_key_trigger();
    elsif tg_tag = 'CREATE TRIGGER' then
        perform pgcascade.ddl_fit_key_triggers();
    end if;
    perform pgcascade.ddl_end(tg_tag, pg_catalog.current_schemas(false));
end $$;

create or replace function pgcascade.ddl_trigger_drop() returns event_trigger
language plpgsql security definer as $$
begin
    perform pgcascade.ddl_drop(tg_tag);
end $$;

-- pgcascade.ddl_trigger_tags(what) -> the command tags of ddl_command_start ('ddl_command_start'),
-- and those whose changes to set tables are captured ('tables').  ddl_command_end and sql_drop
-- fire for every command: pgcascade's own schema is guarded from all of them.
create or replace function pgcascade.ddl_trigger_tags(i_what text) returns text[]
language sql immutable as $$
    select case i_what
        when 'ddl_command_start' then array['ALTER TABLE', 'DROP INDEX']
        when 'tables' then array['ALTER TABLE', 'CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO',
                                 'CREATE INDEX', 'ALTER INDEX', 'COMMENT']
        end
$$;
