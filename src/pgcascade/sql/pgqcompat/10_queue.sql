-- pgq compatibility, part 2: queues.  Names, argument and result types, messages and return
-- codes are PgQ 3.5's; the work is done by pgcascade's own functions where one exists.

create or replace function pgq.version() returns text
language sql immutable as $$ select '3.5'::text $$;

-- pgq.quote_fqname(name) -> "schema"."name"; a name without a schema is in public.
create or replace function pgq.quote_fqname(i_name text) returns text
language sql strict immutable as $$
    select case when position('.' in i_name) > 0
                then quote_ident(split_part(i_name, '.', 1)) || '.' || quote_ident(substr(i_name, position('.' in i_name) + 1))
                else 'public.' || quote_ident(i_name) end
$$;

-- pgq.seq_getval(seq) -> the sequence's last_value (not nextval: nothing is consumed).
create or replace function pgq.seq_getval(i_seq_name text) returns int8
language plpgsql strict as $$
declare
    v int8;
begin
    execute 'select last_value from ' || pgq.quote_fqname(i_seq_name) into v;
    return v;
end $$;

-- pgq.seq_setval(seq, value) -> the sequence's value, moved forward to `value`, never back.
create or replace function pgq.seq_setval(i_seq_name text, i_new_value int8) returns int8
language plpgsql strict as $$
declare
    v int8 := pgq.seq_getval(i_seq_name);
begin
    if v < i_new_value then
        perform setval(pgq.quote_fqname(i_seq_name), i_new_value);
        return i_new_value;
    end if;
    return v;
end $$;

-- pgq.upgrade_schema() -> 0: the compatibility schema is upgraded by pgcascade's install.
create or replace function pgq.upgrade_schema() returns int4
language sql as $$ select 0 $$;

-- pgq.create_queue(name) -> 1 created, 0 existed.  A queue made through PgQ's API gets PgQ's
-- ticker defaults (3 s lag, 1 min idle) and PgQ's first tick (event position = last_value).
create or replace function pgq.create_queue(i_queue_name text) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
begin
    if i_queue_name is null then
        raise exception 'Invalid NULL value';
    end if;
    if pgcascade.create_queue(i_queue_name) = 0 then
        return 0;
    end if;
    update pgcascade.queue set queue_ticker_max_lag = '3 seconds', queue_ticker_idle_period = '1 minute'
     where queue_name = i_queue_name;
    update pgcascade.tick t set tick_event_seq = pgq.seq_getval(q.queue_event_seq::text)
      from pgcascade.queue q where q.queue_name = i_queue_name and t.tick_queue = q.queue_id;
    perform pgq.grant_perms(i_queue_name);
    perform pgq.tune_storage(i_queue_name);
    return 1;
end $$;

create or replace function pgq.drop_queue(x_queue_name text, x_force bool) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    v_id int4;
begin
    select queue_id into v_id from pgcascade.queue where queue_name = x_queue_name for update;
    if not found then
        raise exception 'No such event queue';
    end if;
    if not coalesce(x_force, false) then
        perform 1 from pgcascade.subscription where sub_queue = v_id;
        if found then
            raise exception 'cannot drop queue, consumers still attached';
        end if;
    end if;
    perform pgq.unregister_consumer(x_queue_name, c.co_name)
       from pgcascade.subscription s join pgcascade.consumer c on c.co_id = s.sub_consumer
      where s.sub_queue = v_id;
    return pgcascade.drop_queue(x_queue_name, true);
end $$;

create or replace function pgq.drop_queue(x_queue_name text) returns int4
language sql strict as $$ select pgq.drop_queue(x_queue_name, false) $$;

-- pgq.set_queue_config(queue, param, value) -> 1.  PgQ accepts these six names, without the
-- "queue_" prefix; pgcascade's own set_queue_config takes more (disable_insert, ntables).
create or replace function pgq.set_queue_config(x_queue_name text, x_param_name text, x_param_value text)
returns int4
language plpgsql security definer set search_path = pg_catalog as $$
begin
    if x_queue_name is null or x_param_name is null then
        raise exception 'Invalid NULL value';
    end if;
    perform 1 from pgcascade.queue where queue_name = x_queue_name;
    if not found then
        raise exception 'No such event queue';
    end if;
    if x_param_name not in ('ticker_max_count', 'ticker_max_lag', 'ticker_idle_period', 'ticker_paused',
                            'rotation_period', 'external_ticker') then
        -- PgQ's message, with its stray "s"
        raise exception 'cannot change parameter "%s"', x_param_name;
    end if;
    return pgcascade.set_queue_config(x_queue_name, x_param_name, x_param_value);
end $$;

-- pgq.current_event_table(queue) -> the partition that takes the queue's events now.
create or replace function pgq.current_event_table(x_queue_name text) returns text
language plpgsql security definer set search_path = pg_catalog as $$
declare
    q pgcascade.queue;
begin
    select * into q from pgcascade.queue where queue_name = x_queue_name;
    if not found then
        raise exception 'Event queue not found';
    end if;
    if q.queue_disable_insert and current_setting('session_replication_role') <> 'replica' then
        raise exception 'Writing to queue disabled';
    end if;
    return 'pgcascade.' || pgcascade.queue_part_name(q.queue_id, q.queue_cur_table);
end $$;

-- pgq._grant_perms_from(src schema, src table, dst schema, dst table) -> 1: give the
-- destination table the grants the source table has.
create or replace function pgq._grant_perms_from(src_schema text, src_table text, dst_schema text, dst_table text)
returns int4
language plpgsql strict as $$
declare
    g record;
begin
    for g in select grantee, privilege_type, is_grantable from information_schema.table_privileges
              where table_schema = src_schema and table_name = src_table loop
        execute format('grant %s on %I.%I to %s%s', g.privilege_type, dst_schema, dst_table,
                       case when g.grantee = 'PUBLIC' then 'public' else quote_ident(g.grantee) end,
                       case when g.is_grantable = 'YES' then ' with grant option' else '' end);
    end loop;
    return 1;
end $$;

-- pgq.grant_perms(queue) -> 1: readers may read the queue's events, admins insert and
-- truncate them, everyone read its event sequence.
create or replace function pgq.grant_perms(x_queue_name text) returns int4
language plpgsql security definer set search_path = pg_catalog as $$
declare
    q pgcascade.queue;
    k int4;
begin
    select * into q from pgcascade.queue where queue_name = x_queue_name;
    if not found then
        raise exception 'Queue not found';
    end if;
    execute format('grant select on %s to public', q.queue_event_seq);
    execute format('grant usage on %s to pgq_admin', q.queue_event_seq);
    for k in 0 .. q.queue_ntables - 1 loop
        execute format('grant select on pgcascade.%I to pgq_reader', pgcascade.queue_part_name(q.queue_id, k));
        execute format('grant select, insert, truncate on pgcascade.%I to pgq_admin',
                       pgcascade.queue_part_name(q.queue_id, k));
    end loop;
    return 1;
end $$;

-- pgq.tune_storage(queue) -> 1 (0: no such queue): event tables are filled once and
-- truncated, never updated or vacuumed.
create or replace function pgq.tune_storage(i_queue_name text) returns int4
language plpgsql strict security definer set search_path = pg_catalog as $$
declare
    q pgcascade.queue;
    k int4;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name;
    if not found then
        return 0;
    end if;
    for k in 0 .. q.queue_ntables - 1 loop
        execute format('alter table pgcascade.%I set (fillfactor = 100, autovacuum_enabled = off,'
                       ' toast.autovacuum_enabled = off)', pgcascade.queue_part_name(q.queue_id, k));
    end loop;
    return 1;
end $$;
