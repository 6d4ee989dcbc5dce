-- A key column's type changed by DDL run the ordinary way (auto-ddl): the key-change trigger of
-- a set table (90_capture.sql) names the key columns in its condition, so PostgreSQL refuses
-- ALTER COLUMN ... TYPE of one while it is there.  At the start of an ALTER TABLE that changes a
-- column's type the trigger goes, and at its end it comes back; if the command fails, its
-- transaction takes the DROP back too.  (`execute` does the same around a script.)

-- pgcascade.ddl_statement_table(tokens, path) -> the table an ALTER TABLE statement's tokens
-- (ddl_statements) name, resolved as the session resolves it (`path`: its current_schemas),
-- or null.
create or replace function pgcascade.ddl_statement_table(i_toks text[], i_path name[]) returns regclass
language plpgsql stable as $$
declare
    i int := 3;
    parts text[] := '{}';
    s name;
    found_rel regclass;
begin
    if i_toks[i] = 'if' then
        i := i + 2;  -- IF EXISTS
    end if;
    if i_toks[i] = 'only' then
        i := i + 1;
    end if;
    loop
        parts := parts || case when left(i_toks[i], 1) = '"' then quote_ident(substr(i_toks[i], 2))
                               else quote_ident(i_toks[i]) end;
        exit when i_toks[i + 1] is distinct from '.';
        i := i + 2;
    end loop;
    if array_length(parts, 1) > 1 then
        return to_regclass(array_to_string(parts, '.'));
    end if;
    foreach s in array i_path loop
        found_rel := to_regclass(format('%I.%s', s, parts[1]));
        if found_rel is not null then
            return found_rel;
        end if;
    end loop;
    return null;
end $$;

-- pgcascade.ddl_lift_key_trigger(path): ddl_command_start of ALTER TABLE.  When the statement (the
-- query's only one) changes a column's type (TYPE is one of its words) of a table with a
-- key-change trigger, the trigger goes until ddl_restore_key_trigger.
create or replace function pgcascade.ddl_lift_key_trigger(i_path name[]) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    v_toks text[];
    v_count int := 0;
    v_rel regclass;
    v_prev text[];
begin
    if coalesce(current_setting('pgcascade.auto_ddl', true), '') = 'off'
       or not exists (select 1 from pgcascade.auto_ddl) then
        return;
    end if;
    for v_toks in select s from pgcascade.ddl_statements(current_query()) s loop
        v_count := v_count + 1;
    end loop;
    if v_count <> 1 or v_toks[1:2] <> array['alter', 'table'] or not 'type' = any(v_toks) then
        return;
    end if;
    v_rel := pgcascade.ddl_statement_table(v_toks, i_path);
    if v_rel is null or not exists (select 1 from pg_trigger
                                     where tgrelid = v_rel and tgname = '_pgcascade_capture_key') then
        return;
    end if;
    v_prev := pgcascade.ddl_quiet();
    execute format('drop trigger _pgcascade_capture_key on %s', v_rel);
    perform pgcascade.ddl_quiet(v_prev);
    perform set_config('pgcascade.ddl_key_lifted', v_rel::oid::text, true);
end $$;

-- pgcascade.ddl_restore_key_trigger(): ddl_command_end - the key-change trigger that
-- ddl_lift_key_trigger took off, back, on the key the set table has.
create or replace function pgcascade.ddl_restore_key_trigger() returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    v_rel oid := nullif(current_setting('pgcascade.ddl_key_lifted', true), '')::oid;
    v_prev text[];
begin
    if v_rel is null then
        return;
    end if;
    perform set_config('pgcascade.ddl_key_lifted', '', true);
    v_prev := pgcascade.ddl_quiet();
    perform pgcascade.capture_key_trigger(v_rel::regclass, st.key_columns)
       from pgcascade.set_table st
      where to_regclass(st.table_name) = v_rel
      limit 1;
    perform pgcascade.ddl_quiet(v_prev);
end $$;

-- pgcascade.ddl_fit_key_triggers(): ddl_command_end of CREATE TRIGGER.  A BEFORE UPDATE row
-- trigger on a set table (or on a partitioned table, whose partitions get it) may change a key
-- the UPDATE does not name: the table's key-change triggers lose their column list in the same
-- transaction (92_key_triggers.sql), whatever pgcascade.auto_ddl says: no DDL is replicated here.
create or replace function pgcascade.ddl_fit_key_triggers() returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    t record;
    v_prev text[];
begin
    v_prev := pgcascade.ddl_quiet();
    for t in select distinct st.table_name, st.key_columns
               from pg_event_trigger_ddl_commands() c
               join pg_trigger g on c.classid = 'pg_trigger'::regclass and g.oid = c.objid
               cross join lateral (select g.tgrelid union select relid from pg_partition_tree(g.tgrelid)) p(rel)
               join pgcascade.set_table st on to_regclass(st.table_name) = p.rel
    loop
        perform pgcascade.key_triggers_fit(t.table_name::regclass, t.key_columns);
    end loop;
    perform pgcascade.ddl_quiet(v_prev);
end $$;
