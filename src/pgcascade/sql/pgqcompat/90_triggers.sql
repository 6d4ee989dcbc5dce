-- pgq compatibility, part 10: PgQ's capture triggers, logutriga, sqltriga and jsontriga, with
-- PgQ's event formats (C functions in PgQ; PL/pgSQL here - pgcascade's own capture, the
-- statement-level triggers of add-table, is the fast path).  Row triggers; on TRUNCATE they
-- insert an 'R' event.  Arguments: the queue name, then
--   SKIP          in a BEFORE trigger: the event is queued and the row change dropped
--   ignore=a,b    columns left out of the event; an UPDATE of only those makes no event (an
--                 UPDATE that changes nothing makes one, as in PgQ)
--   pkey=a,b      the key columns, instead of the primary key
--   backup        the old row in ev_extra2 (UPDATE; logutriga and jsontriga)
--   deny          refuse every change
--   when=EXPR     queue the event only where EXPR (on the row's columns) is true
--   ev_type=EXPR, ev_data=EXPR, ev_extra1..4=EXPR   override a field with EXPR's value
-- Events: ev_extra1 = schema.table.
--   logutriga  ev_type I:k1,k2 / U: / D:, ev_data the row url-encoded (a null column: its name alone)
--   sqltriga   ev_type I / U / D, ev_data partial SQL: (a,b) values ('1','x') / b='y' where a='1' / a='1'
--   jsontriga  ev_type {"op":"INSERT","table":["schema","table"],"pkey":[...]}, ev_data the row as JSON

-- pgq._urlencode(text) -> the value as PgQ encodes it: a-z, 0-9, '.', '_' and '-' as they are,
-- space as '+', every other byte as %xx.
create or replace function pgq._urlencode(i_value text) returns text
language sql immutable strict as $$
    select coalesce(string_agg(case when b between 48 and 57 or b between 65 and 90 or b between 97 and 122
                                         or b in (45, 46, 95) then chr(b)
                                    when b = 32 then '+'
                                    else '%' || lpad(to_hex(b), 2, '0') end, '' order by k), '')
      from (select get_byte(convert_to(i_value, 'UTF8'), k) as b, k
              from generate_series(0, octet_length(convert_to(i_value, 'UTF8')) - 1) k) bytes
$$;

-- pgq._trigger_columns(table, ignore) -> the columns an event carries, in table order, and
-- whether each is a key column (pkey= given, or the primary key) and its type.
create or replace function pgq._trigger_columns(
    i_table regclass, i_ignore text[], i_pkey text[],
    out col text, out is_key bool, out typ regtype, out key_pos int4)
returns setof record
language sql stable as $$
    select a.attname::text,
           case when i_pkey is not null then a.attname = any(i_pkey) else coalesce(a.attnum = any(i.indkey), false) end,
           a.atttypid::regtype,
           case when i_pkey is not null then array_position(i_pkey, a.attname::text)
                else array_position(i.indkey::int2[], a.attnum) end
      from pg_attribute a
      left join pg_index i on i.indrelid = a.attrelid and i.indisprimary
     where a.attrelid = i_table and a.attnum > 0 and not a.attisdropped
       and not (a.attname = any(coalesce(i_ignore, '{}')))
     order by a.attnum
$$;

-- pgq._json_value(text, type) -> the value as PgQ's jsontriga writes it: integers and booleans
-- bare, timestamps in ISO 8601 (with time zone: in UTC), everything else a JSON string.
create or replace function pgq._json_value(i_value text, i_type regtype) returns text
language sql immutable as $$
    select case
        when i_value is null then 'null'
        when i_type in ('int2'::regtype, 'int4'::regtype, 'int8'::regtype) then i_value
        when i_type = 'bool'::regtype then case when i_value = 't' then 'true' else 'false' end
        when i_type = 'timestamptz'::regtype then to_json(
            to_char(i_value::timestamptz at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
            || rtrim(rtrim(to_char(i_value::timestamptz at time zone 'UTC', '.US'), '0'), '.') || '+00:00')::text
        when i_type = 'timestamp'::regtype then to_json(
            to_char(i_value::timestamp, 'YYYY-MM-DD"T"HH24:MI:SS')
            || rtrim(rtrim(to_char(i_value::timestamp, '.US'), '0'), '.'))::text
        else to_json(i_value)::text
    end
$$;

-- pgq._sql_literal(text) -> the value quoted as sqltriga writes it (null in lower case).
create or replace function pgq._sql_literal(i_value text) returns text
language sql immutable as $$ select coalesce(quote_literal(i_value), 'null') $$;

-- pgq._trigger_image(format, op, columns, types, keys, values, old values, backup) ->
-- array[ev_type, ev_data, null, ev_extra2] of one row change in the trigger's format.
create or replace function pgq._trigger_image(
    i_format text, i_op text, i_names text[], i_types regtype[], i_keys text[],
    i_values text[], i_old text[], i_backup bool)
returns text[]
language sql immutable as $$
    with c as (select * from unnest(i_names, i_types, i_values, i_old) with ordinality u(n, t, v, o, k)),
    url as (select string_agg(pgq._urlencode(n) || coalesce('=' || pgq._urlencode(v), ''), '&' order by k) as img,
                   string_agg(pgq._urlencode(n) || coalesce('=' || pgq._urlencode(o), ''), '&' order by k) as old_img
              from c),
    js as (select '{' || string_agg(to_json(n)::text || ':' || pgq._json_value(v, t), ',' order by k) || '}' as img,
                  '{' || string_agg(to_json(n)::text || ':' || pgq._json_value(o, t), ',' order by k) || '}' as old_img
             from c),
    keyw as (select string_agg(quote_ident(n) || '=' || pgq._sql_literal(o), ' and ' order by array_position(i_keys, n))
                    as w
               from c where n = any(i_keys))
    select case i_format
        when 'logu' then array[i_op || ':' || array_to_string(i_keys, ','), (select img from url), null,
                               case when i_backup and i_op = 'U' then (select old_img from url) end]
        when 'json' then array[null, (select img from js), null,
                               case when i_backup and i_op = 'U' then (select old_img from js) end]
        else array[i_op, case i_op
            when 'I' then (select '(' || string_agg(quote_ident(n), ',' order by k) || ') values ('
                                  || string_agg(pgq._sql_literal(v), ',' order by k) || ')' from c)
            when 'U' then coalesce((select string_agg(quote_ident(n) || '=' || pgq._sql_literal(v), ',' order by k)
                                      from c where v is distinct from o),
                                   -- nothing changed: the key columns, set to themselves
                                   (select string_agg(quote_ident(n) || '=' || pgq._sql_literal(v), ',' order by k)
                                      from c where n = any(i_keys)))
                          || ' where ' || (select w from keyw)
            else (select w from keyw) end, null, null]
    end
$$;

-- pgq._trigger_event(format, op, table, args, new row, old row) -> void: the event of one
-- row change (or of a TRUNCATE: both rows null), queued as the trigger's arguments say.
create or replace function pgq._trigger_event(
    i_format text, i_op text, i_when text, i_table regclass, i_args text[], i_new anyelement, i_old anyelement)
returns bool
language plpgsql as $$
declare
    v_args text[] := array(select unnest(i_args));  -- TG_ARGV counts from 0
    v_queue text := v_args[1];
    v_arg text;
    v_skip bool := false;
    v_backup bool := false;
    v_ignore text[];
    v_pkey text[];
    v_when text;
    v_over text[] := '{}';  -- field=expr overrides
    v_cols record;
    v_names text[];
    v_keys text[];
    v_types regtype[];
    v_values_sql text;
    v_newv text[];
    v_oldv text[];
    v_tab text := (select quote_ident(n.nspname) || '.' || quote_ident(c.relname)
                     from pg_class c join pg_namespace n on n.oid = c.relnamespace where c.oid = i_table);
    ev text[];  -- type, data, extra1..4
    k int4;
    v_changed bool := false;
    v_value text;
    v_op text := case i_op when 'INSERT' then 'I' when 'UPDATE' then 'U' when 'DELETE' then 'D' else 'R' end;
begin
    if v_queue is null then
        raise exception 'pgq trigger must have destination queue as argument';
    end if;
    foreach v_arg in array coalesce(v_args[2:], '{}') loop
        if v_arg = 'SKIP' then v_skip := true;
        elsif v_arg = 'backup' then v_backup := true;
        elsif v_arg = 'deny' then
            raise exception 'Table ''%'' to queue ''%'': change not allowed (%)', v_tab, v_queue, i_op;
        elsif v_arg like 'ignore=%' then v_ignore := string_to_array(substr(v_arg, 8), ',');
        elsif v_arg like 'pkey=%' then v_pkey := string_to_array(substr(v_arg, 6), ',');
        elsif v_arg like 'when=%' then v_when := substr(v_arg, 6);
        elsif v_arg ~ '^ev_(type|data|extra[1-4])=' then v_over := v_over || v_arg;
        else
            raise exception 'pgq.%triga: unknown argument "%"', i_format, v_arg;
        end if;
    end loop;
    if v_skip and i_when <> 'BEFORE' then
        raise exception 'SKIP does not work in AFTER trigger.';
    end if;
    select array_agg(c.col order by o), array_agg(c.typ order by o),
           array_agg(c.col order by c.key_pos) filter (where c.is_key)
      into v_names, v_types, v_keys
      from pgq._trigger_columns(i_table, v_ignore, v_pkey) with ordinality c(col, is_key, typ, key_pos, o);
    v_keys := coalesce(v_keys, '{}');
    if v_op = 'R' then
        ev := array[case when i_format = 'json' then null else v_op end,
                    case when i_format = 'json' then '{}' else '' end];
    else
        if v_op in ('U', 'D') and cardinality(v_keys) = 0 then
            raise exception 'Update/Delete on table without pkey';
        end if;
        if v_when is not null then
            execute format('select (%s)::bool from (select ($1).*) _r', v_when) into v_changed using coalesce(i_new, i_old);
            if not coalesce(v_changed, false) then
                return not v_skip;
            end if;
        end if;
        -- the columns' values as their output functions write them, for both rows: one statement
        v_values_sql := format('select array[%s]::text[]',
                               (select string_agg(format('case when num_nulls(($1).%1$I) = 0 then format(''%%s'', ($1).%1$I) end', n), ', ')
                                  from unnest(v_names) n));
        execute v_values_sql into v_newv using i_new;
        execute v_values_sql into v_oldv using i_old;
        if v_op = 'U' then
            if v_ignore is not null and v_newv is not distinct from v_oldv then
                return not v_skip;  -- only ignored columns changed
            end if;
            if exists (select 1 from unnest(v_names, v_newv, v_oldv) u(n, nv, ov)
                                             where n = any(v_keys) and nv is distinct from ov) then
                raise exception 'primary key update not allowed';
            end if;
        end if;
        ev := pgq._trigger_image(i_format, v_op, v_names, v_types, v_keys,
                                 case when v_op = 'D' then v_oldv else v_newv end, v_oldv, v_backup);
    end if;
    if i_format = 'json' then
        ev[1] := format('{"op":%s,"table":[%s,%s],"pkey":%s}', to_json(i_op),
                        to_json((select n.nspname::text from pg_class c join pg_namespace n on n.oid = c.relnamespace
                                  where c.oid = i_table)),
                        to_json((select c.relname::text from pg_class c where c.oid = i_table)),
                        coalesce((select '[' || string_agg(to_json(kc)::text, ',') || ']' from unnest(v_keys) kc), '[]'));
    end if;
    ev := array[ev[1], ev[2], v_tab, ev[4], null, null];
    foreach v_arg in array v_over loop
        k := case split_part(v_arg, '=', 1) when 'ev_type' then 1 when 'ev_data' then 2 when 'ev_extra1' then 3
                  when 'ev_extra2' then 4 when 'ev_extra3' then 5 else 6 end;
        execute format('select (%s)::text from (select ($1).*) _r', substr(v_arg, position('=' in v_arg) + 1))
           into v_value using coalesce(i_new, i_old);
        ev[k] := v_value;
    end loop;
    perform pgq.insert_event(v_queue, ev[1], ev[2], ev[3], ev[4], ev[5], ev[6]);
    return not v_skip;
end $$;

-- The trigger functions: one per format, all through _trigger_event.
create or replace function pgq._trigger(i_format text, i_tg_op text, i_when text, i_level text, i_table regclass,
                                        i_args text[], i_new anyelement, i_old anyelement)
returns bool
language plpgsql as $$
begin
    if i_level <> 'ROW' and i_tg_op <> 'TRUNCATE' then
        raise exception 'pgq.%triga must be a row trigger (or a TRUNCATE statement trigger)', i_format;
    end if;
    return pgq._trigger_event(i_format, i_tg_op, i_when, i_table, i_args, i_new, i_old);
end $$;

create or replace function pgq.logutriga() returns trigger
language plpgsql as $$
begin
    if tg_op = 'TRUNCATE' then
        perform pgq._trigger('logu', tg_op, tg_when, tg_level, tg_relid, tg_argv, null::text, null::text);
        return null;
    end if;
    if pgq._trigger('logu', tg_op, tg_when, tg_level, tg_relid, tg_argv, new, old) then
        return case when tg_op = 'DELETE' then old else new end;
    end if;
    return null;
end $$;

create or replace function pgq.sqltriga() returns trigger
language plpgsql as $$
begin
    if tg_op = 'TRUNCATE' then
        perform pgq._trigger('sql', tg_op, tg_when, tg_level, tg_relid, tg_argv, null::text, null::text);
        return null;
    end if;
    if pgq._trigger('sql', tg_op, tg_when, tg_level, tg_relid, tg_argv, new, old) then
        return case when tg_op = 'DELETE' then old else new end;
    end if;
    return null;
end $$;

create or replace function pgq.jsontriga() returns trigger
language plpgsql as $$
begin
    if tg_op = 'TRUNCATE' then
        perform pgq._trigger('json', tg_op, tg_when, tg_level, tg_relid, tg_argv, null::text, null::text);
        return null;
    end if;
    if pgq._trigger('json', tg_op, tg_when, tg_level, tg_relid, tg_argv, new, old) then
        return case when tg_op = 'DELETE' then old else new end;
    end if;
    return null;
end $$;
